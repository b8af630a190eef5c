"""FLOPs formula vs torch's FlopCounterMode on the real model; MFU/HFU; peak table; JSONL, console and wandb."""

import json
import sys
import time
import types

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import ModelConfig
from megatron_lite.metrics import flops
from megatron_lite.metrics.flops import (
    layer_flops_per_token,
    model_flops_per_token,
    peak_flops,
    recompute_flops_per_token,
    step_flops,
)
from megatron_lite.metrics.logger import MetricsLogger, resolve_wandb_mode
from megatron_lite.model.gpt import GPT, padded_vocab_size
from tests.utils.models import LLAMA_STYLE
from tests.utils.wandb_reader import read_wandb_history

GPT2 = dict(n_layers=2, n_heads=4, d_model=64, vocab_size=500, seq_len=32)
LLAMA = dict(
    GPT2,
    n_kv_heads=2,
    ffn_hidden=96,
    **LLAMA_STYLE,
)


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_formula_equals_flop_counter_on_the_real_model(kw):
    """FlopCounterMode counts every matmul of forward + backward of the loss. SDPA is forced onto its math
    backend, which the counter sees as bmm ops (QK^T and PV, backward included; GQA expands K/V to every
    query head first) computing the full s x s score matrix; every other counted op is a linear (mm/addmm).
    So, exactly in integers: the linears equal 3 (L dense + 2hV) per token; the bmms equal 3 L core_full per
    token; and our causal total is the linears plus half of the bmms."""
    cfg = ModelConfig(**kw)
    model = GPT(cfg)
    b, s = 3, cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    ops = {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"mm", "addmm", "bmm"}, ops
    n_tok, (dense, core_full) = b * s, layer_flops_per_token(cfg, s, causal=False)
    attention, linears = ops["bmm"], counter.get_total_flops() - ops["bmm"]
    # The head's GEMM runs over the padded vocabulary (aligned for cuBLAS); model FLOPs count the true one.
    padding = 3 * 2 * cfg.d_model * (padded_vocab_size(cfg) - cfg.vocab_size) * n_tok
    assert padding > 0  # vocab 500 pads to 512: the check below tells the two apart
    assert attention == 3 * cfg.n_layers * core_full * n_tok
    assert linears - padding == 3 * (cfg.n_layers * dense + 2 * cfg.d_model * cfg.vocab_size) * n_tok
    assert model_flops_per_token(cfg, s) * n_tok == linears - padding + attention // 2
    assert model_flops_per_token(cfg, s, causal=False) * n_tok == counter.get_total_flops() - padding


@pytest.mark.parametrize("mode, every", [("selective", 1), ("full", 1), ("full", 2)])
def test_hfu_counts_what_recomputation_reruns(mode, every):
    """The extra FLOPs FlopCounterMode sees with recomputation on (math SDPA: two bmms, the full s x s
    matrix) equal recompute_flops_per_token for the math path; torch's early stop skips fc_out in `full`
    and P x V in `selective`, and the count says so. HFU's extra is the same count, causal."""
    cfg = ModelConfig(**dict(GPT2, n_layers=3))
    b, s = 2, cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1))

    def counted(model: GPT) -> int:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        return counter.get_total_flops()

    model = GPT(cfg)
    baseline = counted(model)
    model.set_recompute(mode, every)
    measured_extra = counted(model) - baseline
    assert measured_extra == recompute_flops_per_token(cfg, s, mode, every, fused_core=False, causal=False) * b * s
    model_flops, hw_flops = step_flops(cfg, b * s, mode, every, fused_core=False)
    assert hw_flops - model_flops == recompute_flops_per_token(cfg, s, mode, every, fused_core=False) * b * s
    dense, core = layer_flops_per_token(cfg, s)
    fc_out = 2 * cfg.ffn * cfg.d_model
    by_hand = {"selective": 3 * core // 2, "full": (3 if every == 1 else 2) * (dense - fc_out + core)}[mode]
    assert hw_flops - model_flops == by_hand * b * s


# Hand-derived per-token forward FLOPs for h=4, a=2, k=1 (GQA), d=2, f=8, s=6, V=10, one layer, SwiGLU:
#   QKV 2*4*(2+2)*2 = 64, out 2*2*2*4 = 32, MLP 2*4*8*3 = 192 (dense 288), core 2*2*6*2*2 / 2 = 48, head 2*4*10 = 80.
TINY = ModelConfig(
    n_layers=1, n_heads=2, n_kv_heads=1, d_model=4, ffn_hidden=8, seq_len=6, vocab_size=10, activation="swiglu"
)


def test_formula_by_hand_and_hfu_per_recompute_mode():
    assert layer_flops_per_token(TINY, 6) == (288, 48)
    fwd = 288 + 48 + 80
    assert model_flops_per_token(TINY, 6) == 3 * fwd == 1248
    assert step_flops(TINY, 100, "none") == (1248 * 100, 1248 * 100)
    assert step_flops(TINY, 100, "selective") == (1248 * 100, (1248 + 48) * 100)  # + attention core forward
    assert step_flops(TINY, 100, "selective", fused_core=False) == (1248 * 100, (1248 + 24) * 100)  # QK^T only
    # + the layer's forward but fc_out (2 f h = 64), which torch's early stop never reruns
    assert step_flops(TINY, 100, "full") == (1248 * 100, (1248 + 288 - 64 + 48) * 100)
    # MFU and HFU share the time, devices and peak; their ratio is hardware / model FLOPs.
    model, hw = step_flops(TINY, 100, "full")
    dt, devices, peak = 0.5, 4, 1e6
    mfu, hfu = model / dt / (devices * peak), hw / dt / (devices * peak)
    assert mfu == pytest.approx(0.0624) and hfu / mfu == pytest.approx(1520 / 1248)
    with pytest.raises(ValueError, match="recompute='some'"):
        step_flops(TINY, 100, "some")


def test_gpt2_124m_flops_per_token_matches_the_usual_estimate():
    """Sanity against 6N + 6·L·s·h (causal-halved attention), N = non-embedding params + head."""
    cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, vocab_size=50257, seq_len=1024)
    n = 12 * 12 * 768**2 + 768 * 50257
    assert model_flops_per_token(cfg, 1024) == 6 * n + 6 * 12 * 1024 * 768


@pytest.mark.parametrize(
    "gpu, dtype, tf32, peak, part",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12, "H100 PCIe"),
        ("NVIDIA H100 NVL", torch.float16, False, 835e12, "H100 NVL"),
        ("NVIDIA H200", torch.float32, True, 494e12, "H200 SXM"),
        ("NVIDIA H200", torch.float32, False, 67e12, "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12, "A100"),
    ],
)
def test_peak_table_by_device_name(monkeypatch, gpu, dtype, tf32, peak, part):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(flops, "_cuda_tf32_allowed", lambda: tf32)
    value, source = peak_flops(torch.device("cuda"), dtype)
    assert value == peak and part in source and gpu in source


def test_cpu_peak_is_probed_once():
    value, source = peak_flops("cpu", torch.float32)
    assert value > 0 and source.startswith("probed")
    assert peak_flops(torch.device("cpu"), torch.float32) == (value, source)  # cached: the same measurement


@pytest.mark.parametrize("call_s, calls", [(0.0, 6), (0.05, 1)])
def test_probe_stops_at_its_budget(monkeypatch, call_s, calls):
    """A fast matmul is timed 5 times after the warm-up; one slower than the whole budget (bf16 on a CPU without
    bf16 units) is timed once, by its warm-up, instead of three times."""
    made = []

    def matmul(a, b):
        made.append(a.shape)
        time.sleep(call_s)

    monkeypatch.setattr(torch, "mm", matmul)
    probed = flops._probe_flops.__wrapped__(torch.device("cpu"), torch.float32, 4, 5, 0.02)
    assert len(made) == calls and probed > 0


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No network and no files outside tmp_path: offline mode, no credentials, wandb's dirs in tmp_path."""
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for key, value in (
        ("WANDB_SILENT", "true"),
        ("WANDB_DISABLE_GIT", "true"),
        ("WANDB_DISABLE_CODE", "true"),
        ("WANDB_CONFIG_DIR", "cfg"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(key, value if value == "true" else str(tmp_path / value))
    return tmp_path / "run"


KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu", "hfu"}


def _record(step):
    return {
        "loss": 5.0 / step,
        "lr": 1e-3 * step / 7,
        "grad_norm": torch.tensor(0.5),
        "tokens": 128 * step,
        "tokens_per_s": 1000.0 + step / 3,
        "step_time_s": 0.1,
        "mfu": 0.1234 + step / 997,
        "hfu": 0.2 + step / 991,
    }


def test_logger_jsonl_wandb_offline_and_resume(offline_wandb, capsys):
    run_dir = offline_wandb
    logger = MetricsLogger(
        str(run_dir),
        {"model": {"d_model": 64}},
        enabled=True,
        wandb_mode="auto",
        run_name="t",
        total_steps=7,
        log_interval=2,
    )
    run_id = logger.wandb_id
    for step in (1, 2, 3):
        logger.log(step, _record(step))
    logger.print("hello from rank 0")
    logger.close()
    logger.close()  # idempotent
    # Two resumes with the same id, usually within the same second: wandb then names the directory
    # offline-run-<second>-<id>-1 instead of replacing the first (the reader orders runs by time).
    for steps in ((4, 5), (6, 7)):
        resumed = MetricsLogger(
            str(run_dir), {}, enabled=True, wandb_mode="offline", wandb_id=run_id, total_steps=7, log_interval=2
        )
        assert resumed.wandb_id == run_id
        for step in steps:
            resumed.log(step, _record(step) | ({"note": "x" * 70_000} if step == 5 else {}))  # > 2 blocks
        resumed.close()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8)) and all(KEYS <= set(r) for r in rows)
    assert rows[0]["grad_norm"] == 0.5  # a 0-d tensor is written as a number
    expected = [{"step": s, **_record(s), "grad_norm": 0.5} for s in range(1, 8)]
    assert [{k: r[k] for k in KEYS} for r in rows] == expected

    # finish() can return before wandb's service has written the last run's buffered records to its .wandb file
    # (a CI run under load found the third run's rows missing); teardown waits for the service to exit, as the end
    # of a training process does.
    import wandb

    wandb.teardown()
    history = read_wandb_history(str(run_dir))
    runs = sorted(p.parent.name for p in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [{k: h[k] for k in KEYS} for h in history] == expected, runs  # exact floats, as logged
    assert [h["_step"] for h in history] == list(range(1, 8)) and len(history[4]["note"]) == 70_000
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 3

    out = capsys.readouterr().out.splitlines()  # stdout is no TTY under pytest: plain lines, every 2nd step + last
    assert [line.split()[1] for line in out if line.startswith("step")] == ["2/7", "4/7", "6/7", "7/7"]
    assert "hello from rank 0" in out and "MFU 12.54%" in out[0]


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path / "x"), {}, enabled=False, wandb_mode="offline")
    logger.log(1, _record(1))
    logger.print("not shown")
    logger.close()
    assert not (tmp_path / "x").exists() and capsys.readouterr().out == ""


def test_wandb_disabled_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    logger = MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled")
    logger.log(1, _record(1))
    logger.close()
    assert logger.wandb_id is None and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_auto_wandb_mode(tmp_path, monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert resolve_wandb_mode("auto") == "offline" and resolve_wandb_mode("online") == "online"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")  # `wandb login`
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled"


def test_status_line_shows_the_pipeline_bubble_only_with_a_pipeline():
    from megatron_lite.metrics.logger import _status_line

    record = {"loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.5}
    assert "bubble" not in _status_line(3, 10, record)
    assert _status_line(3, 10, {**record, "bubble": 0.1875}).endswith("MFU 50.00%  bubble 18.8%")


def test_a_resumed_run_replaces_the_records_of_the_steps_it_runs_again(tmp_path, capsys):
    """A run that went on past its last checkpoint (step 4) logged steps 5 and 6, then crashed mid-line; the
    resumed run drops them (and the cut line) before it logs step 5 again: every step once (issue 23). The
    dropped records go to metrics.dropped.jsonl, said: a fresh run (start_step 0, e.g. from an HF import) in a
    run.dir holding another run's history erased it without a word."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    logger = MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=4)
    logger.log(5, {"loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["loss"] == 0.5
    assert (
        "metrics.jsonl: 2 record(s) of steps after 4 (up to 6), which this run starts before, moved to "
        "metrics.dropped.jsonl" in capsys.readouterr().out
    )
    MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=5).close()  # nothing to drop
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=0).close()  # a fresh run
    assert path.read_text() == ""
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()] == [
        5,
        6,
        1,
        2,
        3,
        4,
        5,
    ]


class _FakeRun:
    def __init__(self, starting_step):
        self.starting_step, self.logged, self.config = starting_step, [], types.SimpleNamespace(updates=[])
        self.config.update = lambda d, allow_val_change=False: self.config.updates.append(d)

    def log(self, record, step):
        self.logged.append(step)

    def finish(self, exit_code=0):
        pass


@pytest.mark.parametrize("starting_step,relogged", [(3, [3, 4, 5]), (0, []), (6, [])])
def test_a_resumed_wandb_run_gets_the_steps_its_server_lost_again(tmp_path, monkeypatch, starting_step, relogged):
    """Online, wandb's resumed run starts after the last step its server has; a crash can lose steps before the
    checkpoint the restart resumes (step 5 here), which metrics.jsonl has: those are logged again, once.
    Offline (starting_step 0) nothing is."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    run, seen = _FakeRun(starting_step), {}

    def init(**kwargs):
        seen.update(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    logger = MetricsLogger(str(tmp_path), {}, True, wandb_mode="offline", wandb_id="abcd1234", start_step=5)
    assert run.logged == relogged and seen["id"] == "abcd1234" and seen["resume"] == "allow"
    assert seen["settings"] == {"x_transaction_log_flush_interval": 1.0}  # not wandb's 15 s
    logger.describe({"world_size": 2})
    assert run.config.updates == [{"run_facts": {"world_size": 2}}]
    logger.log(6, {"loss": 0.5, "val_loss": 0.7, "val_ppl": 2.0, "val_loss/data/a": 0.6})
    assert run.logged == relogged + [6]
    logger.close()


def test_a_run_from_another_runs_checkpoint_is_a_wandb_run_of_its_own(tmp_path):
    """A resume in the run.dir that wrote the checkpoint continues its wandb run; a branch (another run.dir,
    checkpoint.resume=<the other run's step>) starts its own, or it would log into the other's history."""
    from megatron_lite.training import _continued_wandb_id

    meta = {"wandb_id": "abcd1234", "config": {"run": {"dir": str(tmp_path / "main")}}}
    assert _continued_wandb_id(meta, str(tmp_path / "main") + "/") == "abcd1234"
    assert _continued_wandb_id(meta, str(tmp_path / "branch")) is None
    assert _continued_wandb_id({"kind": "weights", "step": 0}, str(tmp_path / "main")) is None
