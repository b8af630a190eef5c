"""The test pool (tests/distributed/pool.py) changes where a run trains, never what it gives.

A run in a pool world that has already trained other configurations equals the same run in a fresh world, bit
for bit (losses and gradient norms); a request that fails raises the rank's error in the test and ends its
world, and the next request gets a fresh world; a run that resumes never goes to a pool world.
"""

import pytest

from tests.distributed import pool
from tests.distributed.common import overrides
from tests.distributed.launcher import resumes, run_configs

pytestmark = pytest.mark.skipif(not pool.enabled(), reason="MEGATRON_LITE_TEST_POOL=0")


def test_a_pool_world_trains_as_a_fresh_one_and_survives_a_failed_request(tmp_path, monkeypatch):
    layout = ["zero.stage=1", "model.dropout=0.1", "train.steps=4"]
    # the world has trained something else first: another model, ZeRO-3 (whose F.linear a run must put back:
    # model/build.restore_functional_linear; without it the norms here differ in the 7th digit)
    run_configs(2, [overrides(tmp_path, "other", "model=llama-tiny", "zero.stage=3", "train.steps=2")], tmp_path)
    (pooled,) = run_configs(2, [overrides(tmp_path, "pooled", *layout)], tmp_path)
    world = pool._worlds[2]
    with pytest.raises(AssertionError, match=r"rank \d raised:(.|\n)*ConfigError"):
        run_configs(2, [overrides(tmp_path, "bad", "train.steps=2", "parallel.tp=3")], tmp_path)
    assert not world.alive()
    (again,) = run_configs(2, [overrides(tmp_path, "again", *layout)], tmp_path)
    assert pool._worlds[2] is not world
    monkeypatch.setenv("MEGATRON_LITE_TEST_POOL", "0")
    (fresh,) = run_configs(2, [overrides(tmp_path, "fresh", *layout)], tmp_path)
    for result in (pooled, again):
        assert result["losses"] == fresh["losses"] and result["grad_norms"] == fresh["grad_norms"]


def test_a_run_that_resumes_gets_a_world_of_its_own():
    assert not resumes(overrides("/tmp", "x"))
    assert resumes(overrides("/tmp", "x", "checkpoint.resume=auto"))
    assert resumes(["train.steps=2"])  # checkpoint.resume's default is auto
