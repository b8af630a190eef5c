"""A real NaN in the loss (tests/distributed/nan_worker.py) skips that step's update on every rank: the weights
after the step equal those before it, and so does the optimizer's state (checkpoints at every step, compared
tensor by tensor, exactly), the next step trains again, and `skipped_steps` counts it. With only one DP
replica's micro-batch poisoned, the others see the NaN through the gradient reduction and skip too (no rank
updates alone, no hang). Consecutive skips up to train.max_skipped_in_row stop the run with exit code 3 and a
one-line error, without saving."""

import glob
import json
import os
import subprocess

import pytest
import torch
from torch.utils._pytree import tree_flatten

from megatron_lite.checkpoint.store import latest_checkpoint, read_meta, step_name
from megatron_lite.checkpoint.weights import load_model_state

# the fault tests train on the real corpus (tests/distributed/common.py, real_corpus_overrides)
from tests.distributed.common import real_corpus_overrides as overrides
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, torchrun_cmd

WORKER = os.path.join(ROOT, "tests/distributed/nan_worker.py")


def train_with_nan(tmp_path, name: str, nan_steps: str, *extra: str, microbatch: str | None = None):
    args = overrides(tmp_path, name, "train.steps=5", "checkpoint.interval=1", "checkpoint.keep=0", *extra)
    env = rank_env(NAN_STEPS=nan_steps, **({"NAN_MICROBATCH": microbatch} if microbatch is not None else {}))
    proc = subprocess.run(
        torchrun_cmd(2, WORKER, *args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    clean_shared_memory()
    return proc, f"{tmp_path}/{name}"


def weights(run_dir: str, step: int) -> dict:
    return load_model_state(os.path.join(run_dir, "checkpoints", step_name(step)))[1]


def optimizer_tensors(run_dir: str, step: int) -> list[torch.Tensor]:
    """Every tensor of every rank's optimizer state in a step's checkpoint: AdamW's moments and step counts
    (ZeRO-0 keeps them in the model-states file, ZeRO 1-3 in one file per rank, with the fp32 master weights)."""
    path = os.path.join(run_dir, "checkpoints", step_name(step))
    states = [
        torch.load(name, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for name in sorted(glob.glob(os.path.join(path, "*optim_states.pt")))
    ]
    states += [
        torch.load(name, map_location="cpu", weights_only=False).get("optimizer")
        for name in sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")))
    ]
    return [leaf for leaf in tree_flatten(states)[0] if isinstance(leaf, torch.Tensor)]


@pytest.mark.parametrize("stage", [0, 2])
def test_nan_step_is_skipped_on_every_rank(stage, tmp_path):
    proc, run_dir = train_with_nan(tmp_path, f"z{stage}", "3", f"zero.stage={stage}", microbatch="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1]
    # a resume continues the count, not from 0
    assert read_meta(os.path.join(run_dir, "checkpoints", step_name(4)))["skipped_steps"] == 1
    assert not torch.isfinite(torch.tensor(records[2]["grad_norm"]))
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in records[3:])
    before, skipped, after = weights(run_dir, 2), weights(run_dir, 3), weights(run_dir, 4)
    for name, value in before.items():
        assert torch.equal(skipped[name], value), f"{name} changed in the skipped step 3"
    assert any(not torch.equal(after[name], value) for name, value in before.items()), "step 4 did not train"
    # AdamW's moments and step counts too (ZeRO-0 skips inside torch's fused AdamW, through its found_inf flag)
    state_before, state_skipped, state_after = (optimizer_tensors(run_dir, step) for step in (2, 3, 4))
    assert state_before and len(state_skipped) == len(state_before), (len(state_before), len(state_skipped))
    assert all(torch.equal(a, b) for a, b in zip(state_skipped, state_before)), "optimizer state moved in step 3"
    assert not all(torch.equal(a, b) for a, b in zip(state_after, state_before)), "step 4 left the state alone"
    assert "update skipped on every rank" in proc.stdout


def test_too_many_nonfinite_steps_in_a_row_stop_without_saving(tmp_path):
    proc, run_dir = train_with_nan(tmp_path, "stop", "3,4,5", "zero.stage=1", "train.max_skipped_in_row=2")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "train.max_skipped_in_row=2: steps 3-4 all had a non-finite loss" in errors[0]
    ckpt = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, step_name(3))  # step 4 stopped the run unsaved
    assert not os.path.exists(os.path.join(ckpt, step_name(4)))
