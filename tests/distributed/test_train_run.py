"""`python train.py` end to end: metrics.jsonl, wandb offline (read back), eval, checkpoints, auto-resume."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lite.checkpoint.manager import said_if_unwritable
from megatron_lite.checkpoint.store import latest_checkpoint, read_meta, step_name
from megatron_lite.errors import RunError
from megatron_lite.training import val_loss_key
from tests.distributed.common import TEST_VOCAB, overrides, test_corpus, write_prepared
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, run_configs
from tests.utils.wandb_reader import read_wandb_history

KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu", "hfu"}


def train(run_dir, *overrides):
    env = rank_env(WANDB_MODE="offline")
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"run.dir={run_dir}",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            "logging.wandb.mode=auto",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    clean_shared_memory()
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_train_py_logs_checkpoints_and_resumes_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    first = train(
        run_dir,
        "train.steps=4",
        "checkpoint.interval=2",
        "train.eval_interval=3",
        "train.eval_iters=2",
        "checkpoint.keep=1",
    )
    assert "MFU" in first.stdout and "peak" in first.stdout and "warning: an evaluation" not in first.stdout
    assert "validation at step 3: loss " in first.stdout  # every evaluation gets a line (log_interval or not)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(KEYS <= set(r) for r in rows)
    # Every eval_interval steps, and the last step (off the interval) too.
    assert [r["step"] for r in rows if "val_loss" in r and "val_ppl" in r] == [3, 4]
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


def test_blend_evaluates_each_dataset_on_its_own(tmp_path):
    """train.eval_per_dataset on a blend of two datasets logs val_loss/<path> for each: at a learning rate of
    1e-9 the weights stay the initial ones (the same seed builds the same model), so each must equal the
    val_loss of a run on that dataset alone (1e-6 relative), and the blend's figures must be the same at dp 2
    and pp 2 (a layout only reorders sums). A larger init_std (0.3) parts the two datasets' losses by 1.9e-2,
    so a swap shows (at 0.02 they were 3e-4 apart)."""
    corpus = test_corpus()[0].split("=", 1)[1]
    other = (
        np.fromfile(os.path.join(ROOT, "data", "shakespeare-8k", "train.bin"), dtype=np.uint16, count=120_000)[40_000:]
        % TEST_VOCAB
    )  # later text than the folded corpus's
    second = write_prepared(tmp_path / "second", {"train": other[:60_000], "val": other[60_000:]}, TEST_VOCAB)
    still = [
        "train.steps=2",
        "train.eval_interval=2",
        "train.eval_iters=2",
        "optim.lr=1e-9",
        "optim.min_lr=0",
        "model.init_std=0.3",
        "checkpoint.interval=0",
        "checkpoint.keep=0",
    ]
    blend = [f"data.path=[{corpus},{second}]", "data.weights=[1,3]", "train.eval_per_dataset=true"]
    run_configs(
        1,
        [
            overrides(tmp_path, "a", *still),
            overrides(tmp_path, "b", *still, f"data.path={second}"),
            overrides(tmp_path, "blend", *still, *blend),
        ],
        tmp_path,
    )
    run_configs(
        2,
        [overrides(tmp_path, "dp2", *still, *blend), overrides(tmp_path, "pp2", *still, *blend, "parallel.pp=2")],
        tmp_path,
    )

    def evaluation(name: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and "val_loss" not in rows[0], name
        return {k: v for k, v in rows[1].items() if k.startswith("val_loss")}

    a, b, blended = evaluation("a"), evaluation("b"), evaluation("blend")
    key_a, key_b = val_loss_key(corpus), val_loss_key(second)
    assert set(blended) == {"val_loss", key_a, key_b} and set(a) == {"val_loss"}, blended
    assert key_b == "val_loss/" + str(tmp_path / "second").lstrip("/")  # the path as given, without a leading /
    assert abs(blended[key_a] / a["val_loss"] - 1) <= 1e-6, (blended, a)  # measured: 0.0
    assert abs(blended[key_b] / b["val_loss"] - 1) <= 1e-6, (blended, b)  # measured: 1.8e-7
    assert abs(a["val_loss"] - b["val_loss"]) > 1e-2, (a, b)  # measured: 1.9e-2 at init_std 0.3
    for name in ("dp2", "pp2"):
        other_layout = evaluation(name)
        assert other_layout.keys() == blended.keys() and all(
            abs(other_layout[k] / blended[k] - 1) <= 1e-6 for k in blended
        ), (name, other_layout, blended)


def test_profile_steps_write_a_trace_of_those_steps_on_those_ranks(tmp_path):
    """train.profile_steps / profile_ranks at dp 2: each named rank writes a Chrome trace holding the window's
    steps and no other, and an op table; a run that ends inside the window writes what it recorded."""
    common = ["train.eval_interval=0", "checkpoint.interval=0", "checkpoint.keep=0"]
    run_configs(
        2,
        [
            overrides(
                tmp_path, "both", *common, "train.steps=4", "train.profile_steps=[2,3]", "train.profile_ranks=[0,1]"
            ),
            overrides(
                tmp_path, "cut", *common, "train.steps=2", "train.profile_steps=[2,5]", "train.profile_ranks=[1]"
            ),
        ],
        tmp_path,
    )

    def steps_in(trace) -> set[str]:
        with gzip.open(trace, "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names, trace
        return {n for n in names if n and n.startswith("step ")}

    for rank in (0, 1):
        assert steps_in(tmp_path / "both" / "profile" / f"rank{rank}_steps2-3.json.gz") == {"step 2", "step 3"}
        assert "aten::" in (tmp_path / "both" / "profile" / f"rank{rank}_steps2-3.txt").read_text()
    assert sorted(os.listdir(tmp_path / "cut" / "profile")) == ["rank1_steps2-2.json.gz", "rank1_steps2-2.txt"]
    assert steps_in(tmp_path / "cut" / "profile" / "rank1_steps2-2.json.gz") == {"step 2"}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_at_a_save_ends_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path, async_save):
    """checkpoint.dir on a 30 MiB tmpfs (root only; skipped otherwise): step 2's checkpoint fits, step 4's does not.
    PyTorch's writer says only "unexpected pos"; the run ends with one line naming the full directory and the
    checkpoint still intact, exit 3 (a restart would fill it again), and `latest` still names step 2. With
    async_save the failure is known a step or more later, in the loop: the line still names step 4 (until
    2026-11-29 it named the step the loop was on) and PyTorch's own words, not only the wrapper's."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        env = rank_env()
        proc = subprocess.run(
            [
                sys.executable,
                "train.py",
                f"run.dir={tmp_path}/run",
                f"checkpoint.dir={small}/ck",
                "train.steps=6",
                "checkpoint.interval=2",
                "checkpoint.keep=1",
                "train.eval_interval=0",
                "logging.wandb.mode=disabled",
                f"checkpoint.async_save={str(async_save).lower()}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        clean_shared_memory()
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        assert proc.returncode == 3 and len(errors) == 1, (proc.returncode, proc.stderr[-2000:])
        assert (
            errors[0].startswith(
                f"error: checkpoint of step 4 could not be written: checkpoint.dir={small}/ck is full ("
            )
            and f"{small}/ck/step_0000002, is intact" in errors[0]
        ), errors[0]
        assert "background write" not in errors[0], errors[0]  # the cause itself, not the wrapper cut short
        assert latest_checkpoint(f"{small}/ck") == f"{small}/ck/{step_name(2)}"
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_checkpoint_dir_turned_read_only_is_said_in_one_line(tmp_path):
    """A file system remounted read-only while the run lives (a storage fault): the failed save is put down to it
    in one line (exit 3), not a traceback that a requeue would repeat. Root only (a tmpfs remounted ro)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ck)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        assert subprocess.run(["mount", "-o", "remount,ro", str(ck)]).returncode == 0
        with pytest.raises(
            RunError,
            match=rf"^checkpoint of step 4 could not be written: checkpoint.dir={ck} is "
            r"read-only \(RuntimeError: Parent directory .*\); none was committed yet: "
            r"make it writable",
        ):
            with said_if_unwritable(str(ck), 4):
                raise RuntimeError("Parent directory /x/step_0000004 does not exist.")  # torch.save's words
        with pytest.raises(ValueError):  # anything else on a writable, roomy file system is not ours to name
            with said_if_unwritable(str(tmp_path), 4):
                raise ValueError("not a storage fault")
    finally:
        subprocess.run(["umount", str(ck)], capture_output=True)


def test_an_evaluation_larger_than_the_validation_split_is_said(tmp_path):
    """eval_iters x global_batch_size samples beyond the split's (360 windows of 128 tokens here): the set wraps
    around and some samples count more than once, which the start of the run says."""
    out = train(
        tmp_path / "run",
        "train.steps=1",
        "train.eval_interval=0",
        "train.eval_iters=50",
        "checkpoint.interval=0",
        "logging.wandb.mode=disabled",
    )
    assert "warning: an evaluation reads" not in out.stdout  # nothing evaluates: nothing said
    out = train(
        tmp_path / "run2",
        "train.steps=1",
        "train.eval_interval=1",
        "train.eval_iters=50",
        "checkpoint.interval=0",
        "logging.wandb.mode=disabled",
    )
    assert (
        "warning: an evaluation reads train.eval_iters x train.global_batch_size = 400 validation samples, more "
        "than the validation split has (data/shakespeare-8k holds 360 for its 400)"
    ) in out.stdout, out.stdout


def test_a_run_from_imported_weights_says_so(tmp_path):
    """A weights-only checkpoint (what an HF import writes) starts a run at step 0, which the start of the run
    says, naming what starts afresh."""
    from omegaconf import OmegaConf

    from megatron_lite.checkpoint.weights import save_model_state
    from megatron_lite.cli import compose_config
    from megatron_lite.model.gpt import GPT

    model_cfg = OmegaConf.to_object(compose_config([])).model
    save_model_state(str(tmp_path / "imported"), model_cfg, GPT(model_cfg, seed=5).state_dict())
    out = train(
        tmp_path / "run",
        "train.steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "logging.wandb.mode=disabled",
        f"checkpoint.resume={tmp_path}/imported/{step_name(0)}",
    )
    assert (
        f"starting from the weights of {tmp_path}/imported/{step_name(0)} (weights only: a new optimizer, "
        "schedule and data stream from step 1)"
    ) in out.stdout, out.stdout


def test_resume_never_keeps_the_checkpoints_already_there(tmp_path):
    """checkpoint.resume=never into a checkpoint.dir that holds an earlier run's checkpoints: the new run's pruning
    (keep=1) would delete them without a word, and a later resume=auto could pick one. They are set aside
    (renamed step_N.before_resume_never.<time>) and said."""
    ck = f"{tmp_path}/ck"
    # two calls: one call's one-rank runs train at once, in the two halves of the pool (launcher.run_configs)
    run_configs(
        1, [overrides(tmp_path, "first", "train.steps=2", "checkpoint.interval=2", f"checkpoint.dir={ck}")], tmp_path
    )
    run_configs(
        1,
        [
            overrides(
                tmp_path,
                "second",
                "train.steps=3",
                "checkpoint.interval=3",
                "checkpoint.keep=1",
                f"checkpoint.dir={ck}",
            )
        ],
        tmp_path,
    )
    names = sorted(os.listdir(ck))
    aside = [n for n in names if n.startswith(f"{step_name(2)}.before_resume_never.")]
    assert len(aside) == 1 and step_name(3) in names and step_name(2) not in names, names
    assert read_meta(os.path.join(ck, aside[0]))["step"] == 2
    assert latest_checkpoint(ck) == os.path.join(ck, step_name(3))
