"""tools/bench_gpu.py's parts that run without a GPU: the markdown of every committed GPU record, and a case that
outruns the run's time budget (killed, reported as an error naming the budget, not hanging the run)."""

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
