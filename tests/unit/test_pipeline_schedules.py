"""Schedules as data, run through the simulator: every (schedule, pp, vpp, m) finishes with no deadlock and the
bubble of its formula; hand-broken schedules are caught, and their error shows the rank x time grid."""

import dataclasses

import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.pipeline.schedules import (
    P2P,
    Comm,
    Compute,
    build_schedule,
    group_size,
    in_flight_bound,
    iterations,
    recv_backward,
    recv_forward,
    resolve_schedule,
    send_backward,
    send_forward,
)
from megatron_lite.pipeline.simulate import ScheduleError, expected_bubble, render_grid, simulate

CASES = [
    (name, pp, vpp, m)
    for pp in (1, 2, 4)
    for vpp in (1, 2, 3)
    for m in sorted({pp, pp + 1, 2 * pp, 2 * pp + 1, 4 * pp})  # pp + 1 and 2pp + 1: pp does not divide m
    for name in ("gpipe", "1f1b", "interleaved")
]


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_schedule_runs_clean_with_formula_bubble(name, pp, vpp, m):
    schedule = build_schedule(name, pp, vpp, m)
    for f_cost, b_cost in ((1.0, 1.0), (1.0, 2.0)):  # the bubble holds for either cost ratio
        result = simulate(schedule, pp, vpp, m, f_cost, b_cost, name=name)
        assert result.bubble == pytest.approx(expected_bubble(name, pp, vpp, m), abs=1e-12)
        # peak activations equal the bound exactly: the bound is tight, not just safe
        assert result.peak_in_flight == [in_flight_bound(name, pp, vpp, m, r) for r in range(pp)]
    if pp == 1:
        assert not any(isinstance(s, Comm) for s in schedule[0])


def test_bubble_table_pp4():
    """The numbers written out, so that a wrong expected_bubble cannot hide behind itself."""
    measured = {}
    for m in (4, 8, 16):
        for name, vpp in (("gpipe", 1), ("1f1b", 1), ("gpipe", 2), ("interleaved", 2)):
            for costs in ((1.0, 1.0), (1.0, 2.0)):
                res = simulate(build_schedule(name, 4, vpp, m), 4, vpp, m, *costs)
                measured[(name, vpp, m, costs)] = res.bubble
    for costs in ((1.0, 1.0), (1.0, 2.0)):
        for m in (4, 8, 16):
            assert measured[("1f1b", 1, m, costs)] == pytest.approx(3 / m)  # (pp-1)/m
            assert measured[("gpipe", 1, m, costs)] == pytest.approx(3 / m)
            assert measured[("interleaved", 2, m, costs)] == pytest.approx(3 / (2 * m))  # (pp-1)/(vpp*m)
            assert measured[("gpipe", 2, m, costs)] == pytest.approx(3 / (2 * m))
    assert measured[("interleaved", 2, 8, (1.0, 2.0))] == 0.1875


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 2), (4, 2, 1), (4, 2, 3), (4, 3, 2), (2, 3, 1)])
def test_gpipe_with_fewer_microbatches_than_ranks(pp, vpp, m):
    # each of the vpp loops through the ranks idles pp - m units: (vpp*(pp-m) + m-1) / (vpp*m)
    res = simulate(build_schedule("gpipe", pp, vpp, m), pp, vpp, m, name="gpipe")
    assert res.bubble == pytest.approx((vpp * (pp - m) + m - 1) / (vpp * m))


def test_pp1_degenerates_to_plain_loops():
    names = lambda sched: [f"{s.kind}{s.microbatch}{s.chunk}" for s in sched[0]]  # noqa: E731
    assert names(build_schedule("1f1b", 1, 1, 3)) == ["F00", "B00", "F10", "B10", "F20", "B20"]
    assert names(build_schedule("gpipe", 1, 1, 2)) == ["F00", "F10", "B00", "B10"]
    # two chunks on one rank: one micro-batch in flight through both chunks, then its backwards
    assert names(build_schedule("interleaved", 1, 2, 2)) == ["F00", "F01", "B01", "F10", "B00", "F11", "B11", "B10"]


def test_warmup_steady_cooldown_shape():
    # 1F1B, pp=4, rank 1: 2 warm-up forwards, then F/B pairs, then 2 cool-down backwards
    kinds = "".join(s.kind for it in iterations("1f1b", 4, 1, 8, 1) for s in it)
    assert kinds == "FF" + "FB" * 6 + "BB"
    # interleaved runs each steady forward + backward as one iteration (one Comm after the pair)
    its = iterations("interleaved", 4, 2, 8, 3)
    assert [len(it) for it in its] == [1] * 4 + [2] * 12 + [1] * 4


def test_group_size_follows_megatron():
    assert [group_size(4, m) for m in (4, 5, 7, 8, 9, 12, 13, 14)] == [4, 5, 7, 4, 5, 4, 7, 5]
    assert group_size(2, 5) == 3  # groups 3 + 2
    assert group_size(4, 2) == 2  # gpipe only: one group


def test_pp2_shares_one_channel_for_acts_and_grads():
    """At pp=2 with vpp>1 activations and gradients to the same peer go in one Comm, in an order both agree on."""
    schedule = build_schedule("interleaved", 2, 2, 4)
    mixed = [s for s in schedule[0] if isinstance(s, Comm)
             and {(op.op, op.kind) for op in s.ops} >= {("send", "act"), ("send", "grad")}]
    assert mixed and all(op.peer == 1 for s in mixed for op in s.ops)
    simulate(schedule, 2, 2, 4)


def test_resolve_schedule():
    assert resolve_schedule("auto", 1) == "1f1b"
    assert resolve_schedule("auto", 2) == "interleaved"
    assert resolve_schedule("1f1b", 3) == "interleaved"
    assert resolve_schedule("interleaved", 1) == "1f1b"
    assert resolve_schedule("gpipe", 2) == "gpipe"
    with pytest.raises(ConfigError, match=r"^parallel.schedule=zb is not a valid choice; use one of auto"):
        resolve_schedule("zb", 1)


def test_too_few_microbatches_is_a_config_error():
    with pytest.raises(ConfigError, match=r"parallel.schedule=1f1b needs at least parallel.pp=4 micro-batches"
                                          r".* got 3 .* parallel.schedule=gpipe"):
        build_schedule("1f1b", 4, 1, 3)


# --- the simulator can fail ------------------------------------------------------------------------------


def _fails(schedule, pp, vpp, m, text, **kw):
    with pytest.raises(ScheduleError) as info:
        simulate(schedule, pp, vpp, m, **kw)
    msg = str(info.value)
    assert text in msg
    assert "time   |" in msg and "rank 0 |" in msg and f"rank {pp - 1} |" in msg  # the grid
    return msg


def _comm_positions(row, pred):
    return [i for i, s in enumerate(row) if isinstance(s, Comm) and any(pred(op) for op in s.ops)]


def test_swapped_recv_order_is_a_mismatch():
    schedule = build_schedule("1f1b", 2, 1, 4)
    row = schedule[1]
    a, b = _comm_positions(row, lambda op: op.op == "recv" and op.kind == "act")[:2]
    row[a], row[b] = row[b], row[a]  # rank 1 now expects micro-batch 1 first
    _fails(schedule, 2, 1, 4, "mismatched")


def test_swapped_act_and_grad_in_one_batch_is_a_mismatch():
    # pp=2, vpp=2: both kinds travel 1 -> 0 in one Comm; NCCL pairs by order, so swapping them corrupts
    schedule = build_schedule("interleaved", 2, 2, 4)
    row = schedule[0]
    i = next(i for i in _comm_positions(row, lambda op: op.op == "recv")
             if {op.kind for op in row[i].ops if op.op == "recv"} == {"act", "grad"})
    row[i] = Comm(tuple(reversed(row[i].ops)))
    _fails(schedule, 2, 2, 4, "mismatched")


def test_backward_before_forward():
    schedule = build_schedule("1f1b", 2, 1, 2)
    row = schedule[1]  # the last stage: its B0 needs no message, only F0
    f0, b0 = row.index(Compute("F", 0, 0)), row.index(Compute("B", 0, 0))
    row[f0], row[b0] = row[b0], row[f0]
    _fails(schedule, 2, 1, 2, "backward before its forward")


def test_missing_step():
    schedule = build_schedule("1f1b", 2, 1, 3)
    schedule[0].remove(Compute("B", 2, 0))  # stage 0 sends nothing after it, so only the count notices
    _fails(schedule, 2, 1, 3, "rank 0 never runs B")
    schedule = build_schedule("1f1b", 2, 1, 3)
    assert schedule[1][-1] == Comm((P2P("send", 0, "grad", 2, 0),))
    del schedule[1][-1]  # rank 0 waits forever for the last gradient
    msg = _fails(schedule, 2, 1, 3, "deadlock")
    assert "rank 0 | " in msg and "blocked at" in msg


def test_both_ranks_recv_first_deadlocks():
    act, grad = dict(kind="act", microbatch=0, chunk=0), dict(kind="grad", microbatch=0, chunk=0)
    schedule = [
        [Comm((P2P("recv", 1, **grad),)), Compute("F", 0, 0), Comm((P2P("send", 1, **act),)), Compute("B", 0, 0)],
        [Comm((P2P("recv", 0, **act),)), Compute("F", 0, 0), Compute("B", 0, 0), Comm((P2P("send", 0, **grad),))],
    ]
    msg = _fails(schedule, 2, 1, 1, "deadlock")
    assert "blocked at step 0" in msg


def test_recv_just_before_use_deadlocks_interleaved():
    """The obvious placement (after each compute: its send + the recv the next compute needs) hangs at pp=2:
    each rank blocks in a send whose recv the other posts only after a compute it cannot reach yet."""
    naive = []
    for rank in range(2):
        computes = [s for it in iterations("interleaved", 2, 2, 4, rank) for s in it]
        made = lambda s: (send_forward if s.kind == "F" else send_backward)(rank, 2, 2, s)  # noqa: E731
        need = lambda s: (recv_forward if s.kind == "F" else recv_backward)(rank, 2, 2, s)  # noqa: E731
        row = [Comm((need(computes[0]),))] if need(computes[0]) else []
        for i, step in enumerate(computes):
            ops = [made(step)] + ([need(computes[i + 1])] if i + 1 < len(computes) else [])
            row += [step] + ([Comm(tuple(op for op in ops if op))] if any(ops) else [])
        naive.append(row)
    _fails(naive, 2, 2, 4, "deadlock")


def test_in_flight_above_bound():
    # gpipe holds every forward; judged against the 1F1B bound it must fail
    _fails(build_schedule("gpipe", 2, 1, 4), 2, 1, 4, "above the 1f1b bound", name="1f1b")


def test_render_grid_of_a_bare_schedule():
    text = render_grid(build_schedule("interleaved", 2, 2, 2))
    assert text.splitlines()[1].split("|")[1].split()[:4] == ["F0a", "F1a", "F0b", "F1b"]
    res = simulate(build_schedule("1f1b", 2, 1, 2), 2, 1, 2, 1.0, 2.0)
    assert render_grid(res).splitlines()[1:] == ["rank 0 | F0 F1 .  .  B0 ~  .  B1 ~",
                                                 "rank 1 | .  F0 B0 ~  F1 B1 ~  .  ."]
    assert dataclasses.is_dataclass(res.timelines[0][0]) and res.makespan == 9.0  # (m + pp - 1) * (f + b)
