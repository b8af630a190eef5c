"""HF parity: random local HF GPT-2 / Llama models import with identical logits and loss, and export back."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from megatron_lite.checkpoint import load_model_state
from megatron_lite.model.gpt import GPT
from tools.convert_hf import ConversionError, export_hf, hf_to_ours, import_hf, ours_to_hf

VOCAB = 1000  # not a multiple of 64: exercises the padded embedding rows


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama(tied: bool):
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=176, vocab_size=VOCAB,
                                        max_position_embeddings=64, tie_word_embeddings=tied,
                                        rope_theta=500000.0))


MODELS = {"gpt2": gpt2, "llama-untied": lambda: llama(False), "llama-tied": lambda: llama(True)}


def _randomize(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)  # biases and norm gains too, so a mapping mistake cannot hide behind zeros/ones
    return model.eval()


@pytest.mark.parametrize("name", MODELS)
def test_import_gives_identical_logits_and_loss(name):
    hf = _randomize(MODELS[name]())
    cfg, sd = hf_to_ours(hf.state_dict(), hf.config)
    ours = GPT(cfg).eval()
    ours.load_state_dict(sd, strict=True)
    tokens = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        theirs = hf(input_ids=tokens, labels=tokens)
        logits = ours(tokens)
        loss = ours(tokens[:, :-1], tokens[:, 1:])
    assert (logits - theirs.logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_export_round_trips_exactly(name):
    hf = _randomize(MODELS[name]())
    cfg, sd = hf_to_ours(hf.state_dict(), hf.config)
    _, back = ours_to_hf(cfg, sd)
    original = hf.state_dict()
    assert set(back) == set(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key


def test_cli_import_export_through_a_checkpoint(tmp_path):
    hf = _randomize(llama(False))
    hf.save_pretrained(tmp_path / "hf_in")
    step_dir = import_hf(str(tmp_path / "hf_in"), str(tmp_path / "ckpt"))
    cfg, sd = load_model_state(str(tmp_path / "ckpt"))  # via `latest`
    assert step_dir.endswith("step_0000000") and cfg.n_kv_heads == 2
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf_out"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32)
    for key, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("kw", [{"mlp_bias": True}, {"attention_bias": True}])
def test_unsupported_models_are_refused_in_one_line(kw):
    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, **kw)
    with pytest.raises(ConversionError, match="bias"):
        hf_to_ours({}, cfg)


def test_export_from_a_tp_zero0_checkpoint_is_refused_clearly(tmp_path):
    import json

    step = tmp_path / "step_0000002"
    step.mkdir()
    (step / "meta.json").write_text(json.dumps({"kind": "deepspeed", "config": {"model": {}},
                                                "layout": {"tp": 2, "zero_stage": 0}}))
    with pytest.raises(ValueError, match="parallel.tp=2 with zero.stage=0"):
        load_model_state(str(step))
