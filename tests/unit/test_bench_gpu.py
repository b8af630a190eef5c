"""tools/bench_gpu.py's parts that run without a GPU: the markdown of every committed GPU record (gpu_report.py),
a case that outruns the run's time budget (killed, reported as an error naming the budget, not hanging the run),
the hand-over between a case's process and the next one's, the profile's sum of GPU time, and the environment of
the torchrun worlds it starts through tests/gpu."""

import glob
import json
import os
import sys
import time

import pytest

from tools import bench_gpu, gpu_report
from tools.case_process import CaseProcess

RECORDS = sorted(glob.glob(os.path.join(bench_gpu.ROOT, "bench", "results", "gpu_*.json")))


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_every_committed_record_renders(path):
    with open(path) as f:
        record = json.load(f)
    text = gpu_report.markdown(record)
    for r in record["throughput"]:  # one table row per case, measured or failed
        head = (
            f"| {r['model']} | {r['micro_batch']} x {r['seq_len']}"
            if "error" not in r
            else f"| {r['model']} | | {r['side']} | failed"
        )
        rows = [line for line in text.splitlines() if line.startswith(head) and f" | {r['side']} |" in line]
        assert len(rows) == 1, (head, text)
    for reached in record.get("not_reached", []):
        assert reached in text


def test_a_case_past_the_budget_is_stopped_and_reported():
    r = bench_gpu.run_side("gpt2-124m", 2, 256, "ours-auto", quick=True, profile_dir=None, timeout=0.2)
    assert r["model"] == "gpt2-124m" and r["side"] == "ours-auto"
    assert r["error"].startswith("stopped after") and "budget" in r["error"], r


# A stand-in for `bench_gpu.py --serve` (which needs CUDA): starts up for START_S seconds, then speaks its protocol
# and reports when it was ready and when it was told to go, as wall-clock times.
FAKE_SERVE = """
import json, sys, time
start_s, fail = float(sys.argv[1]), sys.argv[2]
time.sleep(start_s)
ready = time.time()
print("some library's start-up chatter", flush=True)
print("READY", flush=True)
spec = sys.stdin.readline().strip()
if fail == "crash":
    sys.exit("case crashed: " + spec)
if fail != "hang":
    print("WARM", flush=True)
sys.stdin.readline()
print("CASE " + json.dumps({"spec": spec, "ready": ready, "go": time.time()}), flush=True)
"""


def fake(start_s: float, fail: str = "") -> CaseProcess:
    return CaseProcess(cmd=[sys.executable, "-c", FAKE_SERVE, str(start_s), fail])


def test_a_case_is_timed_only_once_the_next_case_has_started_up():
    """Case i's timed steps wait for case i+1's process to finish its start-up (its imports), so that no
    start-up loads the host while a case is timed; the start-ups still overlap the previous case's set-up."""
    first, second = fake(0.0), fake(1.5)
    t0 = time.time()
    r1 = bench_gpu.run_side("gpt2-124m", 8, 1024, "ours-auto", False, None, 30, process=first, after=second)
    r2 = bench_gpu.run_side("gpt2-124m", 8, 1024, "hf", False, None, 30, process=second, after=None)
    assert r1["spec"] == "gpt2-124m,8,1024,ours-auto,3,12" and r2["spec"] == "gpt2-124m,8,1024,hf,3,12"
    assert r1["go"] >= r2["ready"], "the first case was timed while the second was still starting up"
    assert r2["ready"] - t0 < 2.5, "the second process did not start up during the first case"
    assert first.proc.returncode == 0 and second.proc.returncode == 0


def test_a_case_that_fails_or_hangs_is_reported_and_the_next_one_runs():
    crashed = bench_gpu.run_side("gpt-1.3b", 4, 2048, "hf", False, None, 30, process=fake(0.0, "crash"))
    assert crashed["error"] == "case crashed: gpt-1.3b,4,2048,hf,3,12", crashed
    hung, after = fake(0.0, "hang"), fake(0.0)
    stopped = bench_gpu.run_side("gpt-1.3b", 4, 2048, "compiled", False, None, 1.0, process=hung, after=after)
    assert stopped["error"] == "stopped after 1 s (the run's budget)" and hung.proc.poll() is not None, stopped
    assert bench_gpu.run_side("gpt-1.3b", 4, 2048, "ours-auto", False, None, 30, process=after)["go"]


def test_profile_sums_each_kernel_once():
    """The profile's "GPU kernels" per step counts the kernels' rows: not the op rows above them (CPU rows whose
    device time repeats their kernels') nor a user annotation's GPU range (Optimizer.step#AdamW.step spans the
    fused AdamW kernels, and was counted twice in the H100 profiles of f4f137b)."""
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    events = [
        event(cpu, 300.0),
        event(cuda, 200.0),
        event(cuda, 100.0),  # aten::mm, its two kernels
        event(cuda, 50.0, annotation=True),
        event(cuda, 50.0),
    ]  # Optimizer.step, multi_tensor_apply
    assert bench_gpu.device_seconds(events) == pytest.approx(350e-6)


def test_torchrun_worlds_keep_the_callers_python_path(monkeypatch):
    """On an offline GPU node the packages may be installed with `pip --target` and found through PYTHONPATH: the
    torchrun worlds that tests/gpu and the tools start must keep it (they used to replace it with the checkout)."""
    from megatron_lite.parallel.context import torchrun_env

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/site", "/opt/more"]))
    env = torchrun_env("/repo", TMPDIR="/scratch")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/repo", "/opt/site", "/opt/more"]
    assert (env["TMPDIR"], env["OMP_NUM_THREADS"], env["WANDB_MODE"]) == ("/scratch", "1", "disabled")
    monkeypatch.delenv("PYTHONPATH")
    assert torchrun_env("/repo")["PYTHONPATH"] == "/repo"


def test_accumulation_sides_split_the_same_tokens_into_micro_batches():
    overrides, recast = bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-accum4-recast")
    assert "train.micro_batch_size=1" in overrides and "train.global_batch_size=4" in overrides and recast
    overrides, recast = bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-auto")
    assert "train.micro_batch_size=4" in overrides and "train.global_batch_size=4" in overrides and not recast
    with pytest.raises(AssertionError, match="do not split"):
        bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-accum3")
    with pytest.raises(AssertionError, match="unknown side"):
        bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-accum")


def test_global_batch_sides_accumulate_and_compare_with_baselines_at_the_same_batch():
    """A global<n> side trains n sequences a step in micro-batches of the model's shape; its table row names the
    micro-batches a step and its ratios are against the baselines at the same global batch."""
    overrides, _ = bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-compile-global16")
    assert "train.micro_batch_size=4" in overrides and "train.global_batch_size=16" in overrides
    assert "train.compile=true" in overrides
    assert bench_gpu.global_batch("compiled-global16", 4) == 16 and bench_gpu.global_batch("compiled", 4) == 4
    with pytest.raises(AssertionError, match="not whole micro-batches"):
        bench_gpu.global_batch("ours-global6", 4)
    with pytest.raises(AssertionError, match="unknown side"):
        bench_gpu.side_overrides("gpt-1.3b", 4, 2048, "ours-globalx")

    def row(side, tokens_per_s, glob=4):
        return {
            "model": "gpt-1.3b",
            "side": side,
            "micro_batch": 4,
            "global_batch": glob,
            "seq_len": 2048,
            "step_s": 0.1,
            "tokens_per_s": tokens_per_s,
            "tflops": 1.0,
            "mfu": 0.5,
            "mem_peak_gib": 1.0,
        }

    record = {
        "device": "GPU",
        "date": "d",
        "commit": "c",
        "torch": "t",
        "triton": "t",
        "peak_tflops": 989.0,
        "ceilings": {"copy_GBps": 1.0, "matmul_bf16_tflops": 1.0},
        "tests": {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []},
        "throughput": [
            row("compiled", 100.0),
            row("ours-compile-global16", 150.0, 16),
            row("compiled-global16", 120.0, 16),
            row("ours-compile", 90.0),
        ],
    }
    lines = gpu_report.markdown(record).splitlines()
    glob_row = next(line for line in lines if "| ours-compile-global16 |" in line)
    assert glob_row.startswith("| gpt-1.3b | 4 x 2048, 4 a step |") and glob_row.endswith("| - | 1.25x | - |"), glob_row
    plain_row = next(line for line in lines if "| ours-compile |" in line)
    assert plain_row.endswith("| - | 0.90x | - |"), plain_row


def test_each_of_our_sides_is_priced_by_the_planner_as_plan_measured_prices_its_rows():
    """make bench-gpu records the planner's step time beside ours-* sides (predicted_step_s): the side's own
    config, priced on this machine's GPU (cluster.gpu=auto: an h100-sxm on a machine without one), is what
    plan/measured.py prices for the same recorded run; and the report shows it with its error."""
    from megatron_lite.plan.measured import MEASURED, predict_run, predicted_step_s

    for run in [r for r in MEASURED if r.gpu == "h100-sxm"]:
        overrides, _ = bench_gpu.side_overrides(
            run.model, run.micro_batch, {"gpt-1.3b": 2048}.get(run.model, 1024), run.side
        )
        assert predict_run(overrides).step.total_s == pytest.approx(predicted_step_s(run)), run
    with open(RECORDS[0]) as f:
        record = json.load(f)
    row = dict(record["throughput"][0], predicted_step_s=0.1379, predicted_error=-0.1873)
    text = gpu_report.markdown(dict(record, throughput=[row]))
    assert "| 137.9, -18.7% |" in text, text


def test_float8_sides_turn_on_train_fp8_and_the_larger_model_fits_its_shape():
    """ours-fp8 is rowwise, ours-fp8tensorwise tensorwise, every other side none; llama-3b (the float8 sides'
    larger model) composes at its benchmark shape and is not in the default run."""
    for side, recipe in (("ours-fp8-compile", "rowwise"), ("ours-fp8tensorwise", "tensorwise"), ("ours-auto", "none")):
        overrides, _ = bench_gpu.side_overrides("llama-3b", 1, 2048, side)
        assert f"train.fp8={recipe}" in overrides, side
    assert "llama-3b" not in bench_gpu.DEFAULT_MODELS and set(bench_gpu.FP8_SIDES) >= {"ours-fp8", "ours-auto"}
    cfg = bench_gpu._model_cfg("llama-3b", 2048)
    assert (cfg.n_layers, cfg.d_model, cfg.kv_heads, cfg.ffn) == (28, 3072, 8, 8192)
