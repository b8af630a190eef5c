"""The test pool (tests/distributed/pool.py) changes where a run trains, never what it gives: a pooled run after
other configurations equals a run in a fresh world (tests/distributed/test_zero.py, after a ZeRO-3 run). Here: a
request that fails raises the rank's error in the test and ends its world, the next request gets a fresh world,
and a run that resumes or compiles never goes to a pool world.
"""

import pytest

from tests.distributed import pool
from tests.distributed.common import overrides
from tests.distributed.launcher import compiles, resumes, run_configs

pytestmark = pytest.mark.skipif(not pool.enabled(), reason="MEGATRON_LITE_TEST_POOL=0")


def test_a_failed_request_ends_its_world_and_the_next_gets_a_fresh_one(tmp_path):
    run_configs(2, [overrides(tmp_path, "first", "train.steps=1")], tmp_path)
    world = pool._worlds[2, 0]
    with pytest.raises(AssertionError, match=r"rank \d raised:(.|\n)*ConfigError"):
        run_configs(2, [overrides(tmp_path, "bad", "train.steps=1", "parallel.tp=3")], tmp_path)
    assert not world.alive()
    (again,) = run_configs(2, [overrides(tmp_path, "again", "train.steps=2")], tmp_path)
    assert pool._worlds[2, 0] is not world and pool._worlds[2, 0].alive() and len(again["losses"]) == 2


def test_one_rank_lists_train_in_two_worlds_at_once_in_order_and_fail_together(tmp_path):
    """A one-rank list is split between two one-rank worlds (launcher.run_configs): the summaries come back in
    the list's order, and a failure in one half ends both worlds, the one still training included."""
    with pytest.raises(AssertionError, match=r"rank 0 raised:(.|\n)*ConfigError"):
        run_configs(
            1,
            [
                overrides(tmp_path, "bad", "train.steps=1", "parallel.tp=3"),
                overrides(tmp_path, "meanwhile", "train.steps=4"),
            ],
            tmp_path,
        )
    ended = [world for (nproc, _), world in pool._worlds.items() if nproc == 1]
    assert len(ended) == 2 and not any(world.alive() for world in ended)
    runs = [overrides(tmp_path, f"run{i}", f"train.steps={i}") for i in (1, 2, 3)]
    assert [len(r["losses"]) for r in run_configs(1, runs, tmp_path)] == [1, 2, 3]
    assert pool._worlds[1, 0].alive() and pool._worlds[1, 1].alive()


def test_a_run_that_resumes_or_compiles_gets_a_world_of_its_own():
    assert not resumes(overrides("/tmp", "x"))
    assert resumes(overrides("/tmp", "x", "checkpoint.resume=auto"))
    assert resumes(["train.steps=2"])  # checkpoint.resume's default is auto
    assert not compiles(overrides("/tmp", "x")) and not compiles(["train.compile=false"])
    assert compiles(overrides("/tmp", "x", "train.compile=true"))
