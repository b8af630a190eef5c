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
    held_bound,
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


ZB_CASES = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in sorted({pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp})]


@pytest.mark.parametrize("pp,m", ZB_CASES)
def test_zb_h1_runs_clean_with_formula_bubble(pp, m):
    """F = B = W (the paper's setting): the bubble of the formula, 1F1B's activations on every rank, and
    pp forwards awaiting their W on every rank (1F1B's first-rank bound); W never before its B (simulator)."""
    schedule = build_schedule("zb_h1", pp, 1, m)
    result = simulate(schedule, pp, 1, m, f_cost=1.0, b_cost=2.0, w_cost=1.0, name="zb_h1")
    assert result.bubble == pytest.approx(expected_bubble("zb_h1", pp, 1, m, 1.0, 2.0, 1.0), abs=1e-12)
    assert result.peak_in_flight == [in_flight_bound("1f1b", pp, 1, m, r) for r in range(pp)]
    assert result.peak_held == [held_bound("zb_h1", pp, 1, m, r) for r in range(pp)] == [min(pp, m)] * pp
    for rank in range(pp):  # every step once, and each W after its own B
        computes = [s for s in schedule[rank] if isinstance(s, Compute)]
        assert sorted((s.kind, s.microbatch) for s in computes) == sorted(
            (kind, mb) for kind in "FBW" for mb in range(m)
        )
        assert all(computes.index(Compute("W", mb, 0)) > computes.index(Compute("B", mb, 0)) for mb in range(m))


def test_zb_h1_bubble_table_pp4():
    """pp=4, F = B = W: a third of 1F1B's bubble, written out. With a W cheaper than B (the attention core's
    backward is all B) and with a dearer one, still below 1F1B: comms sit on a unit-cost clock
    (schedules.place_comms), so unequal costs add waits, which the simulator measures."""
    for m in (4, 8, 16):
        zb = simulate(build_schedule("zb_h1", 4, 1, m), 4, 1, m, 1.0, 2.0, w_cost=1.0).bubble
        one_f_one_b = simulate(build_schedule("1f1b", 4, 1, m), 4, 1, m, 1.0, 2.0).bubble
        assert one_f_one_b == pytest.approx(3 / m) and zb == pytest.approx(1 / m)  # (pp-1)/(3m)
        for w_cost in (0.8, 1.2):
            assert simulate(build_schedule("zb_h1", 4, 1, m), 4, 1, m, 1.0, 2.0, w_cost=w_cost).bubble < one_f_one_b


def test_zb_h1_shape():
    """pp=4, m=8: rank 0 holds its W's until its forwards are done; rank 3 runs r=3 (F, B) pairs first."""
    names = lambda r: " ".join(f"{s.kind}{s.microbatch}" for it in iterations("zb_h1", 4, 1, 8, r) for s in it)  # noqa: E731
    assert names(0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert names(3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    res = simulate(build_schedule("zb_h1", 2, 1, 2), 2, 1, 2, 1.0, 2.0, w_cost=1.0)
    assert render_grid(res).splitlines()[1:] == ["rank 0 | F0 F1 .  B0 W0 B1 W1", "rank 1 | .  F0 B0 F1 B1 W0 W1"]


@pytest.mark.parametrize("pp,m", ZB_CASES)
def test_zbv_runs_clean_with_formula_bubble(pp, m):
    """Two chunks in a V (stages r and 2pp-1-r on rank r), F = B = W per chunk: from m = 2pp-1 micro-batches on,
    the bubble of the formula, (pp-1)/(6m); below that the V does not fill (still under 1F1B's). Activations
    held: at most 2pp chunks (pp stages' layers, 1F1B's first-rank bound) on every rank."""
    schedule = build_schedule("zbv", pp, 2, m)
    result = simulate(schedule, pp, 2, m, f_cost=1.0, b_cost=2.0, w_cost=1.0, name="zbv")
    one_f_one_b = simulate(build_schedule("1f1b", pp, 1, m), pp, 1, m, 1.0, 2.0).bubble
    if m >= 2 * pp - 1:
        assert result.bubble == pytest.approx(expected_bubble("zbv", pp, 2, m, 1.0, 2.0, 1.0), abs=1e-12)
        assert result.bubble == pytest.approx((pp - 1) / (6 * m))
    assert result.bubble <= one_f_one_b
    assert result.peak_in_flight == [in_flight_bound("zbv", pp, 2, m, r) for r in range(pp)]
    assert max(result.peak_held) <= 2 * pp
    for rank in range(pp):
        computes = [s for s in schedule[rank] if isinstance(s, Compute)]
        assert sorted((s.kind, s.microbatch, s.chunk) for s in computes) == sorted(
            (kind, mb, chunk) for kind in "FBW" for mb in range(m) for chunk in (0, 1)
        )


def test_zbv_table_pp4():
    """pp=4, F = B = W: 1F1B's bubble 3/m against ZB-V's 1/(2m), below 0.1 from m = 8 on."""
    bubbles = {
        m: simulate(build_schedule("zbv", 4, 2, m), 4, 2, m, 1.0, 2.0, w_cost=1.0, name="zbv").bubble
        for m in (4, 8, 16)
    }
    assert bubbles[8] == pytest.approx(0.0625) and bubbles[16] == pytest.approx(0.03125)
    assert bubbles[4] == pytest.approx(0.2083, abs=1e-4)  # m < 2pp-1: the V never fills


def test_zbv_places_chunks_in_a_v():
    """pp=2: rank 0 holds stages 0 and 3 (data in, loss out), rank 1 stages 1 and 2: the turn 1 -> 2 stays on
    rank 1 (no message), and rank 0's first-chunk gradients come from rank 1's first chunk."""
    schedule = build_schedule("zbv", 2, 2, 2)
    sends = [op for s in schedule[1] if isinstance(s, Comm) for op in s.ops if op.op == "send"]
    assert {(op.kind, op.chunk) for op in sends} == {("act", 1), ("grad", 0)}  # stage 2 -> 3, stage 1 -> 0
    assert all(op.peer == 0 for op in sends)
    names = " ".join(f"{s.kind}{s.microbatch}{'ab'[s.chunk]}" for it in iterations("zbv", 2, 2, 2, 1) for s in it)
    assert names == "F0a F0b F1a F1b B0b W0b B0a B1b B1a W0a W1b W1a"


def test_zb_h1_refuses_chunks():
    with pytest.raises(
        ConfigError,
        match=r"^parallel.schedule=zb_h1 runs one model chunk per pipeline rank, "
        r"got parallel.vpp=2; use parallel.vpp=1",
    ):
        build_schedule("zb_h1", 2, 2, 4)


def test_weight_gradient_before_its_backward():
    schedule = build_schedule("zb_h1", 2, 1, 2)
    row = schedule[1]
    b0, w0 = row.index(Compute("B", 0, 0)), row.index(Compute("W", 0, 0))
    row[b0], row[w0] = row[w0], row[b0]
    _fails(schedule, 2, 1, 2, "weight gradient before its input gradient")
    schedule = build_schedule("zb_h1", 2, 1, 2)
    schedule[0].remove(Compute("W", 1, 0))
    _fails(schedule, 2, 1, 2, "rank 0 never runs W")


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
    mixed = [
        s
        for s in schedule[0]
        if isinstance(s, Comm) and {(op.op, op.kind) for op in s.ops} >= {("send", "act"), ("send", "grad")}
    ]
    assert mixed and all(op.peer == 1 for s in mixed for op in s.ops)
    simulate(schedule, 2, 2, 4)


def test_resolve_schedule():
    assert resolve_schedule("auto", 1) == "1f1b"
    assert resolve_schedule("auto", 2) == "interleaved"
    assert resolve_schedule("1f1b", 3) == "interleaved"
    assert resolve_schedule("interleaved", 1) == "1f1b"
    assert resolve_schedule("gpipe", 2) == "gpipe"
    assert resolve_schedule("zb_h1", 1) == "zb_h1"
    assert resolve_schedule("zbv", 2) == "zbv"
    with pytest.raises(
        ConfigError,
        match=r"^parallel.schedule=zbv runs two model chunks per pipeline rank \(a V\), "
        r"got parallel.vpp=1; use parallel.vpp=2$",
    ):
        resolve_schedule("zbv", 1)
    with pytest.raises(ConfigError, match=r"^parallel.schedule=zb is not a valid choice; use one of auto"):
        resolve_schedule("zb", 1)


def test_too_few_microbatches_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"parallel.schedule=1f1b needs at least parallel.pp=4 micro-batches"
        r".* got 3 .* parallel.schedule=gpipe",
    ):
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
    i = next(
        i
        for i in _comm_positions(row, lambda op: op.op == "recv")
        if {op.kind for op in row[i].ops if op.op == "recv"} == {"act", "grad"}
    )
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
    assert render_grid(res).splitlines()[1:] == [
        "rank 0 | F0 F1 .  .  B0 ~  .  B1 ~",
        "rank 1 | .  F0 B0 ~  F1 B1 ~  .  .",
    ]
    assert dataclasses.is_dataclass(res.timelines[0][0]) and res.makespan == 9.0  # (m + pp - 1) * (f + b)
