"""`python train.py` end to end: metrics.jsonl, wandb offline (read back), eval, checkpoints, auto-resume."""

import json
import os
import subprocess
import sys

from megatron_lite.checkpoint.store import latest_checkpoint, read_meta, step_name
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env
from tests.utils.wandb_reader import read_wandb_history

KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu", "hfu"}


def train(run_dir, *overrides):
    env = rank_env(WANDB_MODE="offline")
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run([sys.executable, "train.py", f"run.dir={run_dir}", "train.global_batch_size=8",
                           "train.micro_batch_size=4", "logging.wandb.mode=auto", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    clean_shared_memory()
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_train_py_logs_checkpoints_and_resumes_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_dir, "train.steps=4", "checkpoint.interval=2", "train.eval_interval=2",
                  "train.eval_iters=2", "checkpoint.keep=1")
    assert "MFU" in first.stdout and "peak" in first.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(KEYS <= set(r) for r in rows)
    assert "val_loss" in rows[1] and "val_ppl" in rows[3] and "val_loss" not in rows[0]
    assert all(0 < r["mfu"] == r["hfu"] for r in rows)  # no recomputation: HFU equals MFU
    assert [r["tokens"] for r in rows] == [8 * 128 * s for s in (1, 2, 3, 4)]

    ckpt = str(run_dir / "checkpoints")
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, step_name(4))
    assert not os.path.exists(os.path.join(ckpt, step_name(2)))  # keep=1 pruned it
    meta = read_meta(latest_checkpoint(ckpt))
    assert meta["step"] == 4 and meta["consumed_samples"] == 32 and meta["layout"]["dp"] == 1

    # The same command with more steps resumes from `latest` and continues the same wandb run.
    train(run_dir, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep=1")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    history = read_wandb_history(str(run_dir))
    assert [h["mfu"] for h in history if "mfu" in h] == [r["mfu"] for r in rows]
    assert read_meta(latest_checkpoint(ckpt))["wandb_id"] == meta["wandb_id"]
