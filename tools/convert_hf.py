"""Convert between HF `GPT2LMHeadModel` / `LlamaForCausalLM` directories and megatron_lite checkpoints.

    python tools/convert_hf.py import <hf_dir> <checkpoint_dir>    # weights-only checkpoint, step 0
    python tools/convert_hf.py export <checkpoint_path> <hf_dir>   # any checkpoint (root or step dir)

One name table per flavour serves both directions (ours <- HF):
  GPT-2: Conv1D weights are (in, out), so they are transposed; c_attn is already [q | k | v] and c_fc is
         the whole GeLU input projection, so both map 1:1 onto our fused qkv / fc_in.
  Llama: q/k/v_proj are concatenated into qkv (biases too, when attention_bias = mlp_bias = True);
         gate/up_proj into fc_in as [gate | up]. RoPE uses the same rotate-half convention on both sides,
         so no permutation of q/k rows is needed.
  Both:  our embedding (and untied head) has padded rows (a multiple of model.vocab_multiple); zeros on
         import, stripped on export. HF buffers that are not weights (GPT-2's attention masks before
         transformers 5, RoPE inv_freq tables) are skipped; any other HF tensor we have no place for is refused.
         Dropout: GPT-2's attn/resid/embd_pdrop (equal) are our model.dropout both ways; a Llama's
         attention_dropout must be 0 on import (ours also drops on the residual branches), and our dropout is
         exported as it (said).
Left out on purpose: RoPE scaling variants (linear, dynamic, yarn, llama3), a Llama with only one of
attention_bias / mlp_bias, head_dim != hidden_size / heads, hub downloads (local directories only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.checkpoint.store import LATEST, read_meta  # noqa: E402
from megatron_lite.checkpoint.weights import load_model_state, save_model_state, step_dir  # noqa: E402
from megatron_lite.config import ModelConfig, data_paths, override_value, repo_path  # noqa: E402
from megatron_lite.model.fused_rows import segments_of  # noqa: E402
from megatron_lite.model.gpt import padded_vocab_size  # noqa: E402

FLAVOURS = ("gpt2", "llama")
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Non-persistent or legacy HF buffers: causal masks (GPT-2, transformers < 5) and RoPE frequency tables.
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class ConversionError(ValueError):
    """A model or checkpoint we cannot represent; its message is one line: what, the value, and a fix."""


def _refuse(what: str, value, fix: str):
    raise ConversionError(f"{what}={value} is not supported; {fix}")


# --- configs -------------------------------------------------------------------------------------------------


def _rope_theta(hf) -> float:
    """RoPE base. transformers 5 moves rope_theta into `rope_parameters` (aliased as `rope_scaling`, with
    rope_type='default' for plain RoPE); 4.x keeps `rope_theta` on the config and scaling under `type`."""
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        _refuse("Llama rope_type", kind, "our model has plain RoPE only (rope_type=default)")
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    return float(10000.0 if theta is None else theta)


def hf_config_to_model_config(hf_config) -> ModelConfig:
    """Our ModelConfig for an HF GPT2Config or LlamaConfig; ConversionError for anything it cannot express."""
    hf = hf_config
    if hf.model_type == "gpt2":
        if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse("GPT-2 activation_function", hf.activation_function, "use gelu_new (tanh GeLU)")
        if not hf.scale_attn_weights or hf.scale_attn_by_inverse_layer_idx or hf.add_cross_attention:
            _refuse(
                "GPT-2 scale_attn_weights/scale_attn_by_inverse_layer_idx/add_cross_attention",
                f"{hf.scale_attn_weights}/{hf.scale_attn_by_inverse_layer_idx}/{hf.add_cross_attention}",
                "only plain causal GPT-2 attention (True/False/False) converts",
            )
        drops = {hf.attn_pdrop, hf.resid_pdrop, hf.embd_pdrop}
        if len(drops) > 1:  # our model.dropout is all three
            _refuse(
                "GPT-2 attn_pdrop/resid_pdrop/embd_pdrop",
                f"{hf.attn_pdrop}/{hf.resid_pdrop}/{hf.embd_pdrop}",
                "our model has one dropout for attention, residual branches and embeddings: set the three equal "
                "in config.json",
            )
        return ModelConfig(
            name="hf-gpt2",
            n_layers=hf.n_layer,
            n_heads=hf.n_head,
            d_model=hf.n_embd,
            ffn_hidden=hf.n_inner or 4 * hf.n_embd,
            vocab_size=hf.vocab_size,
            seq_len=hf.n_positions,
            norm="layernorm",
            norm_eps=hf.layer_norm_epsilon,
            activation="gelu",
            position="learned",
            tie_embeddings=bool(hf.tie_word_embeddings),
            bias=True,
            dropout=float(drops.pop()),
        )
    if hf.model_type == "llama":
        theta = _rope_theta(hf)
        attn_bias, mlp_bias = bool(hf.attention_bias), bool(getattr(hf, "mlp_bias", False))
        if attn_bias != mlp_bias:  # our one `bias` flag covers attention and MLP linears together
            _refuse(
                "Llama attention_bias/mlp_bias",
                f"{attn_bias}/{mlp_bias}",
                "our model has biases on all linears or none, so both must be equal",
            )
        if hf.hidden_act != "silu":
            _refuse("Llama hidden_act", hf.hidden_act, "only silu (SwiGLU) converts")
        if getattr(hf, "attention_dropout", 0.0):
            _refuse(
                "Llama attention_dropout",
                hf.attention_dropout,
                "our model.dropout also drops on the residual "
                "branches and embeddings, which Llama does not: set it to 0.0 in config.json (and train with "
                "model.dropout as you choose)",
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            _refuse(
                "Llama head_dim",
                head_dim,
                f"our heads split hidden_size={hf.hidden_size} evenly "
                f"(head_dim {hf.hidden_size // hf.num_attention_heads})",
            )
        return ModelConfig(
            name="hf-llama",
            n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads,
            n_kv_heads=hf.num_key_value_heads,
            d_model=hf.hidden_size,
            ffn_hidden=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            seq_len=hf.max_position_embeddings,
            norm="rmsnorm",
            norm_eps=hf.rms_norm_eps,
            activation="swiglu",
            position="rope",
            rope_theta=theta,
            tie_embeddings=bool(hf.tie_word_embeddings),
            bias=attn_bias,
            dropout=0.0,
        )
    _refuse("model_type", hf.model_type, "use a GPT-2 (GPT2LMHeadModel) or Llama (LlamaForCausalLM) model")


def _hf_config(cfg: ModelConfig, flavour: str, special: dict | None = None):
    """HF config of our model; special: bos/eos/pad token ids (unknown ones None, not the flavour's defaults,
    which belong to another tokenizer: Llama's eos 2 is a '"' in the bundled 8k one)."""
    from transformers import GPT2Config, LlamaConfig

    special = {**dict.fromkeys(SPECIAL_TOKENS), **(special or {})}

    if flavour == "gpt2":
        if not (cfg.norm == "layernorm" and cfg.activation == "gelu" and cfg.bias and cfg.kv_heads == cfg.n_heads):
            instead = (
                "export as llama instead"
                if cfg.position == "rope"
                else "Llama needs RoPE, so no transformers class holds this learned-position model"
            )
            _refuse(
                "GPT-2 export of norm/activation/bias/n_kv_heads",
                f"{cfg.norm}/{cfg.activation}/{cfg.bias}/{cfg.kv_heads}",
                f"GPT-2 needs layernorm/gelu/True/{cfg.n_heads}; {instead}",
            )
        return GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.ffn,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            tie_word_embeddings=cfg.tie_embeddings,
            **special,
        )
    if not (cfg.norm == "rmsnorm" and cfg.activation == "swiglu" and cfg.position == "rope"):
        _refuse(
            "Llama export of norm/activation/position",
            f"{cfg.norm}/{cfg.activation}/{cfg.position}",
            "Llama needs rmsnorm/swiglu/rope; export a learned-position model as gpt2",
        )
    if cfg.dropout:  # the weights and logits are the same; only training from the export would differ
        print(
            f"convert_hf: model.dropout={cfg.dropout} is exported as Llama's attention_dropout only (Llama has no "
            "residual or embedding dropout)",
            file=sys.stderr,
        )
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_dropout=cfg.dropout,
        **special,
    )


# --- name tables -----------------------------------------------------------------------------------------------


def _table(cfg: ModelConfig, flavour: str):
    """(our name, HF names concatenated along dim 0 into it, HF stores it transposed?) for every weight
    except the vocabulary-sized ones (padded on our side, handled by _vocab_names)."""
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    if flavour == "gpt2":
        yield "wpe.weight", ("transformer.wpe.weight",), False
        for i in range(cfg.n_layers):
            o, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs, conv1d in (
                ("norm1", "ln_1", False),
                ("attn.qkv", "attn.c_attn", True),
                ("attn.proj", "attn.c_proj", True),
                ("norm2", "ln_2", False),
                ("mlp.fc_in", "mlp.c_fc", True),
                ("mlp.fc_out", "mlp.c_proj", True),
            ):
                for kind in kinds:  # Conv1D stores its weight (in, out); biases are plain vectors
                    yield f"{o}{ours}.{kind}", (f"{h}{theirs}.{kind}",), conv1d and kind == "weight"
        for kind in kinds:
            yield f"norm_f.{kind}", (f"transformer.ln_f.{kind}",), False
        return
    for i in range(cfg.n_layers):
        o, h = f"blocks.{i}.", f"model.layers.{i}."
        yield f"{o}norm1.weight", (f"{h}input_layernorm.weight",), False
        yield f"{o}norm2.weight", (f"{h}post_attention_layernorm.weight",), False
        for kind in kinds:
            yield f"{o}attn.qkv.{kind}", tuple(f"{h}self_attn.{x}_proj.{kind}" for x in "qkv"), False
            yield f"{o}attn.proj.{kind}", (f"{h}self_attn.o_proj.{kind}",), False
            yield f"{o}mlp.fc_in.{kind}", (f"{h}mlp.gate_proj.{kind}", f"{h}mlp.up_proj.{kind}"), False
            yield f"{o}mlp.fc_out.{kind}", (f"{h}mlp.down_proj.{kind}",), False
    yield "norm_f.weight", ("model.norm.weight",), False


def _vocab_names(flavour: str) -> dict[str, str]:
    embed = "transformer.wte.weight" if flavour == "gpt2" else "model.embed_tokens.weight"
    return {"wte.weight": embed, "lm_head.weight": "lm_head.weight"}


def _flavour_of(cfg: ModelConfig) -> str:
    return "gpt2" if cfg.position == "learned" else "llama"


# --- state dicts -----------------------------------------------------------------------------------------------


def hf_to_ours(hf_state_dict: dict, hf_config) -> tuple[ModelConfig, dict]:
    """(our ModelConfig, fp32 state dict that `GPT(cfg).load_state_dict(sd)` takes strictly)."""
    cfg = hf_config_to_model_config(hf_config)
    flavour, rows, sd = _flavour_of(cfg), padded_vocab_size(cfg), hf_state_dict
    vocab = _vocab_names(flavour)
    wanted = {"wte.weight": (vocab["wte.weight"],)}
    if not cfg.tie_embeddings:
        wanted["lm_head.weight"] = (vocab["lm_head.weight"],)
    transposed = {}
    for ours, theirs, t in _table(cfg, flavour):
        wanted[ours], transposed[ours] = theirs, t
    missing = [n for names in wanted.values() for n in names if n not in sd]
    if missing:
        raise ConversionError(
            f"HF state dict lacks {missing[:3]} ({len(missing)} in all) that its config "
            "implies; is the config the one these weights were saved with?"
        )
    used = {n for names in wanted.values() for n in names} | {vocab["lm_head.weight"]}  # tied head: a copy
    extra = [k for k in sd if k not in used and not k.endswith(_HF_BUFFERS)]
    if extra:
        raise ConversionError(
            f"HF weights {extra[:3]} ({len(extra)} in all) have no place in our model; "
            "only plain GPT-2 / Llama causal LMs convert"
        )
    out = {}
    for ours, theirs in wanted.items():
        w = torch.cat([sd[n] for n in theirs]) if len(theirs) > 1 else sd[theirs[0]]
        out[ours] = w.t() if transposed.get(ours) else w
    for name in ("wte.weight", "lm_head.weight"):
        if name in out and out[name].shape[0] < rows:  # zero rows up to the padded vocabulary
            out[name] = torch.cat([out[name], out[name].new_zeros(rows - out[name].shape[0], cfg.d_model)])
    return cfg, {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in out.items()}


def ours_to_hf(
    model_cfg: ModelConfig, our_state_dict: dict, flavour: str | None = None, special: dict | None = None
) -> tuple[object, dict]:
    """(HF config, HF state dict) for our weights; flavour gpt2 or llama, by default gpt2 for learned positions;
    special: the bos/eos/pad token ids to record (special_tokens)."""
    cfg, sd = model_cfg, our_state_dict
    flavour = flavour or _flavour_of(cfg)
    if flavour not in FLAVOURS:
        _refuse("flavour", flavour, f"use one of {', '.join(FLAVOURS)}")
    if (flavour == "gpt2") != (cfg.position == "learned"):
        _refuse(f"{flavour} export of position", cfg.position, "GPT-2 has learned positions, Llama RoPE")
    hf_cfg = _hf_config(cfg, flavour, special)
    out = {}
    for ours, theirs, transposed in _table(cfg, flavour):  # fused tensors split into HF's separate ones
        w = sd[ours].t() if transposed else sd[ours]
        out.update(zip(theirs, w.split(segments_of(ours, cfg)) if len(theirs) > 1 else (w,)))
    vocab = _vocab_names(flavour)
    out[vocab["wte.weight"]] = sd["wte.weight"][: cfg.vocab_size]  # strip the padded rows
    head = "wte.weight" if cfg.tie_embeddings else "lm_head.weight"
    out[vocab["lm_head.weight"]] = sd[head][: cfg.vocab_size]  # HF's state_dict lists the tied head too
    return hf_cfg, {k: v.contiguous() for k, v in out.items()}


# --- command line --------------------------------------------------------------------------------------------


def special_tokens(meta: dict) -> dict:
    """bos/eos/pad ids of a checkpoint's tokenizer: those an import recorded; for a trained checkpoint, the end of
    document of the data it trained on (data.path's meta.json), which is the only special token our data has, as
    bos and eos (GPT-2's convention); None where unknown."""
    if meta["kind"] == "weights":
        return {k: v for k, v in meta.get("special_tokens", {}).items() if k in SPECIAL_TOKENS}
    eos = _data_meta(meta).get("eos_id")
    return {} if eos is None else {"bos_token_id": eos, "eos_token_id": eos}


def tokenizer_dir(meta: dict) -> str | None:
    """The local HF tokenizer a trained checkpoint's data was made with (data.tokenizer, else what the data's
    meta.json records), when it is still there; None for an import or where it is gone."""
    if meta["kind"] == "weights":
        return None
    path = meta.get("config", {}).get("data", {}).get("tokenizer") or _data_meta(meta).get("tokenizer")
    return repo_path(path) if path and os.path.isdir(repo_path(path)) else None


def _data_meta(meta: dict) -> dict:
    """The meta.json of the (first) data directory a trained checkpoint's run read; {} where it is gone."""
    path = meta.get("config", {}).get("data", {}).get("path")
    try:
        with open(os.path.join(repo_path(data_paths(path)[0]), "meta.json")) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError, IndexError):
        return {}


def import_hf(hf_dir: str, ckpt_dir: str) -> str:
    """HF directory -> weights-only checkpoint under ckpt_dir (new or empty); returns the step directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"{hf_dir} is not a directory; pass a local HF model directory (no hub downloads)")
    held = (
        sorted(n for n in os.listdir(ckpt_dir) if n == LATEST or n.startswith("step_"))
        if os.path.isdir(ckpt_dir)
        else []
    )
    if held:  # the import commits step 0 and moves `latest` to it: a run there would start over its checkpoints
        raise ConversionError(
            f"checkpoint_dir={ckpt_dir} already holds checkpoints ({', '.join(held[:3])}); import "
            "into a new or empty directory and train with checkpoint.dir set to it"
        )
    hf_config_to_model_config(AutoConfig.from_pretrained(hf_dir, local_files_only=True))  # refuse before loading
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    cfg, sd = hf_to_ours(model.state_dict(), model.config)
    special = {k: getattr(model.config, k, None) for k in SPECIAL_TOKENS}
    return save_model_state(ckpt_dir, cfg, sd, extra_meta={"special_tokens": special})


def model_overrides(cfg: ModelConfig) -> str:
    """The model.* overrides that train a checkpoint of this shape: every field that differs from the defaults."""
    default = ModelConfig()
    return " ".join(
        f"model.{f.name}={override_value(getattr(cfg, f.name))}"
        for f in fields(cfg)
        if getattr(cfg, f.name) != getattr(default, f.name)
    )


def export_hf(ckpt_path: str, hf_dir: str, flavour: str | None = None) -> None:
    """Checkpoint (root with `latest`, or step dir) -> HF directory (safetensors + config.json)."""
    from transformers import AutoModelForCausalLM

    cfg, sd = load_model_state(ckpt_path)
    meta = read_meta(step_dir(ckpt_path))
    hf_cfg, hf_sd = ours_to_hf(cfg, sd, flavour, special_tokens(meta))
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.load_state_dict(hf_sd, strict=True)
    model.save_pretrained(hf_dir)
    tokenizer = tokenizer_dir(meta)
    if tokenizer is not None:  # a self-contained HF directory: AutoTokenizer.from_pretrained(hf_dir) works
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(hf_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="HF directory -> weights-only checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("checkpoint_dir")
    exp = sub.add_parser("export", help="checkpoint (root or step dir) -> HF directory")
    exp.add_argument("checkpoint_path")
    exp.add_argument("hf_dir")
    exp.add_argument("--flavour", choices=FLAVOURS, help="default: gpt2 for learned positions, llama for RoPE")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            path = import_hf(args.hf_dir, args.checkpoint_dir)
            shape = model_overrides(ModelConfig(**read_meta(path)["model"]))
            run_dir = os.path.join("runs", os.path.basename(os.path.normpath(args.checkpoint_dir)))  # its own metrics
            print(
                f"wrote {path}; train from it with: python train.py checkpoint.dir={args.checkpoint_dir} "
                f"run.dir={run_dir} {shape}"
            )
        else:
            if os.path.exists(args.hf_dir) and not os.path.isdir(
                args.hf_dir
            ):  # transformers only warns, writes nothing
                sys.exit(f"convert_hf: {args.hf_dir} is a file; give a directory to write the HF model to")
            export_hf(args.checkpoint_path, args.hf_dir, args.flavour)
            print(f"wrote {args.hf_dir}")
    except (ValueError, FileNotFoundError) as err:  # ConversionError, unsupported checkpoint layouts
        sys.exit(f"convert_hf: {err}")


if __name__ == "__main__":
    main()
