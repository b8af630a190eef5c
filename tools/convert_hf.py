"""Convert between HF `GPT2LMHeadModel` / `LlamaForCausalLM` directories and megatron_lite checkpoints.

    python tools/convert_hf.py import <hf_dir> <checkpoint_dir>    # weights-only checkpoint, step 0
    python tools/convert_hf.py export <checkpoint_path> <hf_dir>   # any checkpoint (root or step dir)

Name and layout mapping (ours <- HF):
  GPT-2: Conv1D weights are (in, out), so they are transposed; c_attn is already [q | k | v] and c_fc is
         the whole GeLU input projection, so both map 1:1 onto our fused qkv / fc_in.
  Llama: q/k/v_proj are concatenated into qkv; gate/up_proj into fc_in as [gate | up]. RoPE uses the same
         rotate-half convention on both sides, so no permutation of q/k rows is needed.
  Both:  our embedding (and untied head) has padded rows (a multiple of model.vocab_multiple); zeros on
         import, stripped on export.
Left out on purpose: rope scaling variants, MLP/attention-output biases on Llama, sharded HF downloads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.checkpoint import load_model_state, save_model_state  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.model.gpt import padded_vocab_size  # noqa: E402


class ConversionError(ValueError):
    pass


def hf_config_to_model_config(hf) -> ModelConfig:
    if hf.model_type == "gpt2":
        if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConversionError(f"GPT-2 activation_function={hf.activation_function} is not supported; "
                                  "use gelu_new (tanh GeLU)")
        return ModelConfig(
            name="hf-gpt2", n_layers=hf.n_layer, n_heads=hf.n_head, d_model=hf.n_embd,
            ffn_hidden=hf.n_inner or 4 * hf.n_embd, vocab_size=hf.vocab_size, seq_len=hf.n_positions,
            norm="layernorm", norm_eps=hf.layer_norm_epsilon, activation="gelu", position="learned",
            tie_embeddings=True, bias=True, dropout=0.0,
        )
    if hf.model_type == "llama":
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConversionError(f"Llama rope_type={rope.get('rope_type')} is not supported; only default RoPE")
        if getattr(hf, "mlp_bias", False) or getattr(hf, "attention_bias", False):
            raise ConversionError("Llama mlp_bias/attention_bias=True is not supported; only bias-free Llamas")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return ModelConfig(
            name="hf-llama", n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
            n_kv_heads=hf.num_key_value_heads, d_model=hf.hidden_size, ffn_hidden=hf.intermediate_size,
            vocab_size=hf.vocab_size, seq_len=hf.max_position_embeddings, norm="rmsnorm",
            norm_eps=hf.rms_norm_eps, activation="swiglu", position="rope", rope_theta=float(theta),
            tie_embeddings=bool(hf.tie_word_embeddings), bias=False, dropout=0.0,
        )
    raise ConversionError(f"model_type={hf.model_type} is not supported; use a GPT-2 or Llama checkpoint")


def _gpt2_pairs(n_layers: int):
    """(our name, HF name, transposed?) for every GPT-2 tensor but the token embedding and the head."""
    yield "wpe.weight", "transformer.wpe.weight", False
    for i in range(n_layers):
        o, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            for kind in ("weight", "bias"):
                yield f"{o}{ours}.{kind}", f"{h}{theirs}.{kind}", False
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj")):
            yield f"{o}{ours}.weight", f"{h}{theirs}.weight", True  # Conv1D stores (in, out)
            yield f"{o}{ours}.bias", f"{h}{theirs}.bias", False
    for kind in ("weight", "bias"):
        yield f"norm_f.{kind}", f"transformer.ln_f.{kind}", False


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def hf_to_ours(sd: dict, hf_config) -> tuple[ModelConfig, dict]:
    cfg = hf_config_to_model_config(hf_config)
    rows = padded_vocab_size(cfg)
    out = {}
    if hf_config.model_type == "gpt2":
        out["wte.weight"] = _pad_rows(sd["transformer.wte.weight"], rows)
        for ours, theirs, transposed in _gpt2_pairs(cfg.n_layers):
            out[ours] = sd[theirs].t().contiguous() if transposed else sd[theirs]
    else:
        p = "model."
        out["wte.weight"] = _pad_rows(sd[p + "embed_tokens.weight"], rows)
        for i in range(cfg.n_layers):
            h, o = f"{p}layers.{i}.", f"blocks.{i}."
            out[o + "norm1.weight"] = sd[h + "input_layernorm.weight"]
            out[o + "norm2.weight"] = sd[h + "post_attention_layernorm.weight"]
            out[o + "attn.qkv.weight"] = torch.cat([sd[h + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            out[o + "attn.proj.weight"] = sd[h + "self_attn.o_proj.weight"]
            out[o + "mlp.fc_in.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
            out[o + "mlp.fc_out.weight"] = sd[h + "mlp.down_proj.weight"]
        out["norm_f.weight"] = sd[p + "norm.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = _pad_rows(sd["lm_head.weight"], rows)
    return cfg, {k: v.detach().clone().float() for k, v in out.items()}


def ours_to_hf(cfg: ModelConfig, sd: dict):
    """(HF config, HF state dict) for our weights; GPT-2 for learned positions, Llama for RoPE."""
    from transformers import GPT2Config, LlamaConfig

    V, out = cfg.vocab_size, {}
    if cfg.position == "learned":
        if not (cfg.norm == "layernorm" and cfg.activation == "gelu" and cfg.bias and cfg.tie_embeddings
                and cfg.kv_heads == cfg.n_heads):
            raise ConversionError("only GPT-2-shaped models (layernorm, gelu, biases, tied, no GQA) export as GPT-2")
        hf = GPT2Config(vocab_size=V, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
                        n_head=cfg.n_heads, n_inner=cfg.ffn, activation_function="gelu_new",
                        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True)
        out["transformer.wte.weight"] = out["lm_head.weight"] = sd["wte.weight"][:V]
        for ours, theirs, transposed in _gpt2_pairs(cfg.n_layers):
            out[theirs] = sd[ours].t().contiguous() if transposed else sd[ours]
        return hf, out
    if cfg.norm != "rmsnorm" or cfg.activation != "swiglu" or cfg.bias:
        raise ConversionError("only Llama-shaped models (rmsnorm, swiglu, rope, no biases) export as Llama")
    hf = LlamaConfig(vocab_size=V, hidden_size=cfg.d_model, intermediate_size=cfg.ffn,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
                     rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=False,
                     tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu")
    p, q_rows, kv_rows = "model.", cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out[p + "embed_tokens.weight"] = sd["wte.weight"][:V]
    for i in range(cfg.n_layers):
        h, o = f"{p}layers.{i}.", f"blocks.{i}."
        out[h + "input_layernorm.weight"] = sd[o + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[o + "norm2.weight"]
        q, k, v = sd[o + "attn.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = sd[o + "attn.proj.weight"]
        gate, up = sd[o + "mlp.fc_in.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = sd[o + "mlp.fc_out.weight"]
    out[p + "norm.weight"] = sd["norm_f.weight"]
    out["lm_head.weight"] = (sd["wte.weight"] if cfg.tie_embeddings else sd["lm_head.weight"])[:V]
    return hf, {k: v.contiguous() for k, v in out.items()}


def import_hf(hf_dir: str, ckpt_dir: str) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg, sd = hf_to_ours(model.state_dict(), model.config)
    return save_model_state(ckpt_dir, cfg, sd)


def export_hf(ckpt_path: str, hf_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    cfg, sd = load_model_state(ckpt_path)
    hf_cfg, hf_sd = ours_to_hf(cfg, sd)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.load_state_dict(hf_sd, strict=True)
    model.save_pretrained(hf_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="HF directory -> weights-only checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("checkpoint_dir")
    exp = sub.add_parser("export", help="checkpoint (root or step dir) -> HF directory")
    exp.add_argument("checkpoint_path")
    exp.add_argument("hf_dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            print(f"wrote {import_hf(args.hf_dir, args.checkpoint_dir)}")
        else:
            export_hf(args.checkpoint_path, args.hf_dir)
            print(f"wrote {args.hf_dir}")
    except (ValueError, FileNotFoundError) as err:  # ConversionError, unsupported checkpoint layouts
        sys.exit(f"convert_hf: {err}")


if __name__ == "__main__":
    main()
