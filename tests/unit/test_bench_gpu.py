"""tools/bench_gpu.py's parts that run without a GPU: the markdown of every committed GPU record, and a case that
outruns the run's time budget (killed, reported as an error naming the budget, not hanging the run), and the
profile's sum of GPU time."""

import glob
import json
import os

import pytest

from tools import bench_gpu

RECORDS = sorted(glob.glob(os.path.join(bench_gpu.ROOT, "bench", "results", "gpu_*.json")))


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_every_committed_record_renders(path):
    with open(path) as f:
        record = json.load(f)
    text = bench_gpu.markdown(record)
    for r in record["throughput"]:  # one table row per case, measured or failed
        head = f"| {r['model']} | {r['micro_batch']} x {r['seq_len']} | {r['side']} |" if "error" not in r \
            else f"| {r['model']} | | {r['side']} | failed"
        assert text.count(head) == 1, (head, text)
    for reached in record.get("not_reached", []):
        assert reached in text


def test_a_case_past_the_budget_is_stopped_and_reported():
    r = bench_gpu.run_side("gpt2-124m", 2, 256, "ours-auto", quick=True, profile_dir=None, timeout=0.2)
    assert r["model"] == "gpt2-124m" and r["side"] == "ours-auto"
    assert r["error"].startswith("stopped after") and "budget" in r["error"], r


def test_profile_sums_each_kernel_once():
    """The profile's "GPU kernels" per step counts the kernels' rows: not the op rows above them (CPU rows whose
    device time repeats their kernels') nor a user annotation's GPU range (Optimizer.step#AdamW.step spans the
    fused AdamW kernels, and was counted twice in the H100 profiles of f4f137b)."""
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    events = [event(cpu, 300.0), event(cuda, 200.0), event(cuda, 100.0),  # aten::mm, its two kernels
              event(cuda, 50.0, annotation=True), event(cuda, 50.0)]      # Optimizer.step, multi_tensor_apply
    assert bench_gpu.device_seconds(events) == pytest.approx(350e-6)
