"""Checkpoints that break on disk, for real (truncated shard files, a deleted step directory), under
checkpoint.resume=auto on 2 gloo ranks: the run falls back to the newest sound checkpoint, continues with
continuous step numbers and the uninterrupted run's losses and grad norms (exact resume: 1e-6, measured 0),
and keeps the unsound directory aside instead of deleting it. The unit tests (tests/unit/test_checkpoint_store.py)
cover the messages and the refusals."""

import glob
import json
import os
import shutil

from megatron_lite.checkpoint import store

# the fault tests train on the real corpus (tests/distributed/common.py, real_corpus_overrides)
from tests.distributed.common import real_corpus_overrides as overrides
from tests.distributed.launcher import run_configs
from tests.distributed.test_resume import assert_continues

# a constant LR after warmup: the runs stop at different train.steps, which would otherwise reshape the decay
LAYOUT = ["zero.stage=1", "checkpoint.interval=2", "checkpoint.keep=0", "optim.decay=constant"]


def steps_logged(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def test_auto_resume_falls_back_past_truncated_and_missing_checkpoints(tmp_path):
    run_dir, ckpt = f"{tmp_path}/run", f"{tmp_path}/run/checkpoints"
    straight, _ = run_configs(
        2,
        [
            overrides(tmp_path, "straight", "train.steps=10", *LAYOUT),
            overrides(tmp_path, "run", "train.steps=6", *LAYOUT),
        ],
        tmp_path,
    )

    # 1. The newest checkpoint (the one `latest` names) has a truncated shard: resume from step 4.
    newest = os.path.join(ckpt, store.step_name(6))
    victim = max(glob.glob(f"{newest}/*.pt"), key=os.path.getsize)
    truncated = os.path.getsize(victim) // 2
    os.truncate(victim, truncated)
    (second,) = run_configs(
        2, [overrides(tmp_path, "run", "train.steps=8", *LAYOUT, "checkpoint.resume=auto")], tmp_path
    )
    assert steps_logged(run_dir) == [1, 2, 3, 4, 5, 6, 7, 8]  # the resumed run replaced its steps 5 and 6
    assert_continues(
        second,
        {k: v[:8] for k, v in straight.items() if k in ("losses", "grad_norms")},
        1e-6,
        "resumed past a truncated step 6",
    )
    (aside,) = glob.glob(f"{newest}.corrupt.*")  # the unsound checkpoint is kept, under another name
    # as it was left: the rewritten step 6 holds the same values, but its pickle need not have the same size
    assert os.path.getsize(os.path.join(aside, os.path.basename(victim))) == truncated
    assert store.verify(newest, checksums=True) is None  # step 6 rewritten whole by the resumed run

    # 2. `latest` names a directory that is gone: resume from the newest complete one before it (step 6).
    shutil.rmtree(os.path.join(ckpt, store.step_name(8)))
    (third,) = run_configs(
        2, [overrides(tmp_path, "run", "train.steps=10", *LAYOUT, "checkpoint.resume=auto")], tmp_path
    )
    assert steps_logged(run_dir) == list(range(1, 11))  # every step once (steps 7, 8 replaced)
    assert_continues(third, straight, 1e-6, "resumed past a dangling latest")
    assert store.latest_checkpoint(ckpt) == os.path.join(ckpt, store.step_name(10))
