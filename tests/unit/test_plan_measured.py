"""How far the planner's step time is trusted (plan/measured.py) and how `--plan` and `--check` say so: every
layout within the measured error of the fastest is marked, and only those; an unmeasured GPU takes the largest
error of any and is called unvalidated."""

import json
import os
import subprocess
import sys

import pytest

from megatron_lite.plan.measured import MEASURED, multi_gpu_caveat, predicted_step_s, step_error, step_errors
from megatron_lite.plan.report import near_best

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _P:  # the fields near_best reads of a Prediction
    def __init__(self, step_s: float, fits: bool = True):
        self.fits, self.step = fits, type("Step", (), {"total_s": step_s})()


def test_near_best_marks_exactly_what_is_within_the_error_of_the_fastest_that_fits():
    predictions = [_P(0.9, fits=False), _P(1.0), _P(1.1), _P(1.2), _P(1.21), _P(1.19, fits=False)]
    assert near_best(predictions, 0.2) == [False, True, True, True, False, False]
    assert near_best([_P(1.0, fits=False)], 0.2) == [False]


def test_each_gpu_class_takes_its_worst_measured_row_and_an_unmeasured_one_the_worst_of_all():
    errors = step_errors()
    for gpu in ("h100-sxm", "h200"):
        rows = [r for r in MEASURED if r.gpu == gpu]
        assert errors[gpu] == pytest.approx(max(abs(predicted_step_s(r) / r.step_s - 1) for r in rows))
    # today's figures (docs/planner.md 'How far to trust it'): every row within 10% (the H200's, the
    # out-of-sample GPU: the rates were measured on the H100) but gpt2-124m's compiled blocks on the H100 at +10.3%:
    # the planner prices the eager step and does not know train.compile
    assert all(abs(predicted_step_s(r) / r.step_s - 1) < 0.10 for r in MEASURED if "compile" not in r.side)
    assert errors["h100-sxm"] < 0.11 and errors["h200"] < 0.07 and errors["a100-80gb"] < 0.15
    assert step_error("b200") == (max(errors.values()), False)
    assert step_error("h200") == (errors["h200"], True)


def _train_py(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE="8")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_plan_and_check_say_how_far_their_step_time_is_trusted(tmp_path):
    base = ["model=gpt-1.3b", "train.global_batch_size=64", "cluster.nodes=1"]
    plan = _train_py("--plan", *base, "cluster.gpu=h100-sxm", "--json", str(tmp_path / "plan.json"))
    assert plan.returncode == 0, plan.stderr[-2000:]
    error = step_error("h100-sxm")[0]
    rows = json.loads((tmp_path / "plan.json").read_text())
    best = rows[0]["step_time_s"]
    assert [r["within_error_of_best"] for r in rows] == [
        r["fits"] and r["step_time_s"] <= best * (1 + error) for r in rows
    ]
    table = [line for line in plan.stdout.splitlines() if line[:3].strip().isdigit()]
    marked = [line.rstrip().endswith("≈") for line in table]
    assert marked == [False] + [r["within_error_of_best"] for r in rows[1 : len(table)]], plan.stdout
    close = sum(r["within_error_of_best"] for r in rows)
    assert (
        f"within {100 * error:.0f}% of #1's step time" in plan.stdout and f"rank the {close:,} layouts" in plan.stdout
    )
    # 8 GPUs: the H100's error is one GPU's, and MosaicML's published FSDP runs on 8-64 H100s say how far off more
    assert f"That error is one GPU's: {multi_gpu_caveat('h100-sxm')} (docs/planner.md)" in plan.stdout
    check = _train_py("--check", *base, "cluster.gpu=b200", "zero.stage=3", "train.micro_batch_size=1")
    assert check.returncode == 0, check.stderr[-2000:]
    worst = max(step_errors().values())
    assert f"its step time off by up to {100 * worst:.0f}% on b200, unvalidated; that error is one GPU's: no run " in (
        check.stdout
    ), check.stdout


def test_only_the_a100s_error_covers_more_than_one_gpu():
    """The A100's error comes from published runs on 8-3,072 GPUs; the H100's and H200's from our one-GPU runs, and
    MosaicML's FSDP runs on 8-64 H100s took 30-73% longer than the planner predicts for them (today's figures,
    docs/planner.md), so a layout on several of those GPUs is told so."""
    assert multi_gpu_caveat("a100-80gb") == multi_gpu_caveat("a100-40gb") == ""
    assert multi_gpu_caveat("h100-sxm").endswith("8-64 h100-sxms took 30-73% longer than predicted for their layouts")
    assert multi_gpu_caveat("h200") == "no run on several h200s has been held against the planner"
