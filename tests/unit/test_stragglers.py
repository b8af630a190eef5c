"""The straggler report's arithmetic (the slowest rank over the median rank, a streak of the same rank), the
collective clock that busy time is measured with, the identity a report names, and the faults keys' one-line
refusals. The distributed behaviour, with a rank made slow from outside: tests/distributed/test_stragglers.py."""

import socket

import pytest
import torch
import torch.distributed as dist

from megatron_lite.cli import load
from megatron_lite.errors import ConfigError
from megatron_lite.faults import identity
from megatron_lite.faults.stragglers import CollectiveClock, judge


def test_ratio_is_over_the_lower_median_rank():
    report, _ = judge([1.0, 1.1, 3.0, 0.9], threshold=1.5, intervals=3, streak=(None, 0))
    assert report.slowest_rank == 2 and report.ratio == pytest.approx(3.0 / 1.0)  # lower median of 4: 1.0
    report, _ = judge([2.0, 1.0], threshold=1.5, intervals=3, streak=(None, 0))
    assert report.slowest_rank == 0 and report.ratio == pytest.approx(2.0)  # 2 ranks: over the other one
    report, _ = judge([0.0, 0.0], threshold=1.5, intervals=3, streak=(None, 0))  # nothing measured yet
    assert report.ratio == 1.0 and not report.flagged


def test_the_same_rank_must_stay_over_the_ratio_for_the_set_reports():
    streak, flagged_at = (None, 0), []
    slow = [1.0, 1.0, 2.0, 1.0]
    intervals = [slow, slow, [1.0, 1.0, 1.0, 1.0], slow, slow, slow, slow, [2.0, 1.0, 1.0, 1.0], slow, slow, slow]
    for i, busy in enumerate(intervals):
        report, streak = judge(busy, threshold=1.5, intervals=3, streak=streak)
        if report.flagged:
            flagged_at.append(i)
            assert report.slowest_rank == 2 and report.streak == 3
    # an even report and another rank's each start the count again; a streak is flagged once, when it reaches 3
    assert flagged_at == [5, 10]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_clock_times_collectives_and_their_waits_and_leaves_torch_as_it_was(one_rank_group):
    originals = {name: getattr(dist, name) for name in ("all_reduce", "batch_isend_irecv", "barrier")}
    clock = CollectiveClock(torch.device("cpu"))
    clock.install()
    try:
        assert dist.all_reduce is not originals["all_reduce"]
        x = torch.ones(4)
        dist.all_reduce(x)
        assert clock.take() > 0 and clock.take() == 0  # taken once
        work = dist.all_reduce(x, async_op=True)
        work.wait()  # an async handle's wait is timed too
        assert clock.take() > 0 and x.tolist() == [1.0] * 4
    finally:
        clock.uninstall()
    assert {name: getattr(dist, name) for name in originals} == originals


def test_a_rank_is_named_with_its_host_and_local_rank(one_rank_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    identity.publish(0)
    assert str(identity.of(0)) == f"rank 0 (host {socket.gethostname()}, local rank 3)"
    assert identity.of(0).named("last finished step 7").endswith("local rank 3; last finished step 7)")
    assert str(identity.of(5)) == "rank 5 (host unknown)"  # never published


@pytest.mark.parametrize(
    "override, message",
    [
        ("faults.straggler_ratio=1.0", "faults.straggler_ratio=1.0 must be a number > 1"),
        ("faults.straggler_ratio=nan", "faults.straggler_ratio=nan must be a number > 1"),
        ("faults.straggler_intervals=0", "faults.straggler_intervals=0 must be >= 1"),
        ("faults.straggler_action=kill", "faults.straggler_action=kill"),
    ],
)
def test_bad_faults_keys_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("+", r"\+")):
        load([override], world_size=2)
    assert load(["faults.straggler_ratio=null"], world_size=2).faults.straggler_ratio is None
