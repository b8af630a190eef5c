"""checkpoint.async_save: a resume from an asynchronous checkpoint continues the straight run exactly (1e-6, as
the synchronous exact resumes in test_resume.py), on every ZeRO stage, at pp=2 x tp=2, with CPU offload and at
cp=2, and through the universal conversion to another DP size (1e-4); a rank SIGKILLed while
its background write runs (a slow disk, injected) leaves the previous checkpoint as `latest`, and the restart
continues from it. The writer's commit rules are unit-tested in tests/unit/test_checkpoint_writer.py."""

import json
import os

import pytest

from megatron_lite.checkpoint.store import latest_checkpoint, step_name
from tests.distributed.common import overrides, real_corpus_overrides
from tests.distributed.launcher import run_configs
from tests.distributed.test_resume import (
    STEPS8,
    assert_continues,
    killed_writing_step_4,
    straight_then_resumed,
    straights_then_resumed,
)

ASYNC = ["checkpoint.async_save=true"]


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


LAYOUTS = {  # dp=2 on every ZeRO stage; offload (the staging copy reads the states where offload keeps them);
    # cp=2 (a cp group's ranks, same weights and other tokens, each stage their own files)
    "zero0": ["zero.stage=0"],
    "zero3": ["zero.stage=3"],
    "zero1": ["zero.stage=1"],
    "zero2": ["zero.stage=2"],
    "zero3_offload_all": ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],
    "cp2_ring": ["parallel.cp=2", "zero.stage=1"],
}


@pytest.mark.parametrize(
    "names",
    [["zero0", "zero3"], pytest.param(["zero1", "zero2", "zero3_offload_all", "cp2_ring"], marks=pytest.mark.slow)],
    ids=["quick", "more"],
)
def test_exact_resume_from_an_async_checkpoint(names, tmp_path):
    """2 ranks: per layout, 8 straight steps saving asynchronously at 4 vs a fresh world resuming from it."""
    results = straights_then_resumed(2, tmp_path, {name: [*LAYOUTS[name], *ASYNC] for name in names})
    for name, (straight, resumed) in results.items():
        ckpt = f"{tmp_path}/{name}/checkpoints"
        records = _metrics(f"{tmp_path}/{name}")
        assert all(r["ckpt_block_s"] >= 0 for r in records if r["step"] in (4, 8)), records
        # each save's write time, logged once, on the step it is known: step 4's on a step from 4 (a write done
        # before the loop looked) to 8 (when step 8's save had to wait for it: then step 8's own write time is
        # ckpt_final_write_s beside it, not in its place), step 8's on step 8
        writes = [(r["step"], key) for r in records for key in ("ckpt_write_s", "ckpt_final_write_s") if key in r]
        assert len(writes) == 2 and writes[-1][0] == 8 and 4 <= writes[0][0] <= 8, (name, records)
        assert_continues(resumed, straight, 1e-6, f"{name}, async checkpoint")
        assert latest_checkpoint(ckpt) == os.path.join(ckpt, step_name(8))
        assert not [n for n in os.listdir(os.path.join(ckpt, step_name(8))) if n.startswith(".share")]


@pytest.mark.slow
def test_exact_resume_from_an_async_checkpoint_pp2_tp2(tmp_path):
    straight, resumed = straight_then_resumed(4, tmp_path, ["parallel.tp=2", "parallel.pp=2", "zero.stage=1", *ASYNC])
    assert_continues(resumed, straight, 1e-6, "pp=2 x tp=2, async checkpoint")


@pytest.mark.slow
def test_async_checkpoint_converts_for_another_dp_size(tmp_path):
    """An asynchronous checkpoint written at dp=2 (ZeRO-2) resumes at dp=1 through the universal conversion,
    continuing the uninterrupted run within 1e-4 (as the synchronous elastic resumes in test_resharding.py)."""
    (straight,) = run_configs(
        2, [overrides(tmp_path, "dp2", *STEPS8, "checkpoint.interval=4", "zero.stage=2", *ASYNC)], tmp_path
    )
    (resized,) = run_configs(
        1,
        [
            overrides(
                tmp_path,
                "dp1",
                *STEPS8,
                "zero.stage=2",
                *ASYNC,
                f"checkpoint.dir={tmp_path}/dp1_ckpt",
                f"checkpoint.resume={tmp_path}/dp2/checkpoints/{step_name(4)}",
            )
        ],
        tmp_path,
    )
    assert len(resized["losses"]) == 4
    assert_continues(resized, straight, 1e-4, "async checkpoint, dp 2 -> 1 resume")
    assert latest_checkpoint(f"{tmp_path}/dp1_ckpt") == os.path.join(f"{tmp_path}/dp1_ckpt", step_name(8))


def test_rank_killed_during_a_background_write(tmp_path):
    """Rank 1's background write of step 4 takes 4 s, then it dies (SIGKILL) mid-file; meanwhile the loop trains
    on. Rank 0's write of step 4 fails at once (its barrier with the dead rank) and ends rank 0 with an error,
    where it used to wait for rank 1's share until torchrun SIGKILLed it 30 s later. `latest` stays step 2, step 4
    has no meta.json, and the restart continues the straight trajectory."""
    args = real_corpus_overrides(tmp_path, "run", *STEPS8, "checkpoint.interval=2", "zero.stage=1", *ASYNC)
    ckpt = f"{tmp_path}/run/checkpoints"
    crashed = killed_writing_step_4(args, ckpt, SLOW_WRITE_S="4")
    assert "the background write of the checkpoint of step 4 failed" in crashed.stderr, crashed.stderr[-3000:]
    assert "exitcode  : 1 (" in crashed.stderr, crashed.stderr[-3000:]  # rank 0 ended itself; not -9 (SIGKILL)
    logged = [r["step"] for r in _metrics(f"{tmp_path}/run")]
    assert 5 in logged, f"the loop waited for the write instead of training on: {logged}"

    resumed, straight = run_configs(
        2,
        [args + ["checkpoint.resume=auto"], real_corpus_overrides(tmp_path, "straight", *STEPS8, "zero.stage=1")],
        tmp_path,
    )
    assert [r["step"] for r in _metrics(f"{tmp_path}/run")][-6:] == [3, 4, 5, 6, 7, 8]
    assert len(resumed["losses"]) == 6
    assert_continues(resumed, straight, 1e-6, "async: restart from step 2")
    assert os.path.isfile(os.path.join(ckpt, step_name(8), "meta.json"))
