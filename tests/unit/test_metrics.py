"""FLOPs formula vs torch's FlopCounterMode on the real model; MFU/HFU; JSONL and wandb offline logging."""

import json
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import ModelConfig
from megatron_lite.metrics import MetricsLogger, layer_flops_per_token, model_flops_per_token, step_flops
from megatron_lite.model.gpt import GPT
from tests.utils.wandb_reader import read_wandb_history

GPT2 = dict(n_layers=2, n_heads=4, d_model=64, vocab_size=500, seq_len=32)
LLAMA = dict(GPT2, n_kv_heads=2, ffn_hidden=96, norm="rmsnorm", activation="swiglu", position="rope",
             bias=False, tie_embeddings=False)


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_formula_equals_flop_counter_on_the_real_model(kw):
    """FlopCounterMode counts every matmul of forward + backward. It sees SDPA only through the math
    backend, which computes the full (non-causal) score matrix, so it is compared with causal=False;
    the causal convention then halves exactly that attention-core term (checked below)."""
    cfg = ModelConfig(**kw)
    model = GPT(cfg)
    b, s = 3, cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert counter.get_total_flops() == model_flops_per_token(cfg, s, causal=False) * b * s
    dense, core_causal = layer_flops_per_token(cfg, s)
    _, core_full = layer_flops_per_token(cfg, s, causal=False)
    assert core_causal * 2 == core_full
    assert model_flops_per_token(cfg, s, causal=False) - model_flops_per_token(cfg, s) == 3 * cfg.n_layers * core_causal


def test_hfu_adds_the_recomputed_forward():
    cfg = ModelConfig(**LLAMA)
    model, hw = step_flops(cfg, 1000, "none")
    assert model == hw == model_flops_per_token(cfg, cfg.seq_len) * 1000
    dense, core = layer_flops_per_token(cfg, cfg.seq_len)
    assert step_flops(cfg, 1000, "selective")[1] - model == pytest.approx(cfg.n_layers * core * 1000)
    assert step_flops(cfg, 1000, "full")[1] - model == pytest.approx(cfg.n_layers * (dense + core) * 1000)


def test_gpt2_124m_flops_per_token_matches_the_usual_estimate():
    """Sanity against 6N + 6·L·s·h (causal-halved attention), N = non-embedding params + head."""
    cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, vocab_size=50257, seq_len=1024)
    n = 12 * 12 * 768**2 + 768 * 50257
    assert model_flops_per_token(cfg, 1024) == 6 * n + 6 * 12 * 1024 * 768


KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu", "hfu"}


def _record(step):
    return {"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens": 128 * step,
            "tokens_per_s": 1000.0 + step, "step_time_s": 0.1, "mfu": 0.1234 + step / 1000, "hfu": 0.2}


def test_logger_writes_jsonl_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = MetricsLogger(str(tmp_path), {"a": 1}, enabled=True, wandb_mode="auto", total_steps=6)
    run_id = logger.wandb_id
    for step in (1, 2, 3):
        logger.log(step, _record(step))
    logger.close()
    # wandb names offline runs offline-run-<second>-<id>: a resume within the same second would reuse the
    # directory and replace the first file (a real restart takes far longer than a second).
    time.sleep(1.1)
    resumed = MetricsLogger(str(tmp_path), {"a": 1}, enabled=True, wandb_mode="offline", wandb_id=run_id)
    for step in (4, 5, 6):
        resumed.log(step, _record(step))
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6] and all(KEYS <= set(r) for r in lines)
    history = read_wandb_history(str(tmp_path))
    assert [h["mfu"] for h in history] == [_record(s)["mfu"] for s in range(1, 7)]
    assert resumed.wandb_id == run_id


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path / "x"), {}, enabled=False, wandb_mode="offline")
    logger.log(1, _record(1))
    logger.close()
    assert not (tmp_path / "x").exists()
