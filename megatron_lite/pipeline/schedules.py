"""Pipeline schedules as data: for each pipeline rank, the ordered list of computations and messages.

A schedule is a pure function of (name, pp, vpp, m); the executor runs any such list and
`simulate.py` checks it (deadlock, order, memory, bubble) with no processes. Notation: pp ranks,
vpp chunks per rank, m micro-batches per step on each pipeline; chunk c of rank r is virtual stage
v = c*pp + r (see partition.py); F = forward, B = backward (input- and weight-grads together), except in the
zero-bubble schedules, which split it: B = the input gradient only, W = the weight gradient, run later
(parallel/weight_grad.py).

Built in two passes:
1. *Iterations* per rank: the computations run between two Comm steps. Every schedule walks Megatron's
   table of (micro-batch, chunk): micro-batches in groups of N >= pp, each group through chunk 0, then
   chunk 1, ...; backwards use the same table with chunks reversed. gpipe runs every forward, then every
   backward. 1F1B / interleaved run `warmup` forwards, then one forward + one backward per step (steady
   state), then the backwards still owed (cool-down). zb_h1 (Qi et al. 2024, "ZB-H1") keeps 1F1B's warm-up
   and memory but delays each W: rank r runs r (F, B) pairs before its first W, then (F, B, W) triples, then
   (B, W) pairs and its last r W's, so the W's fill the idle slots 1F1B leaves at both ends. zbv ("ZB-V",
   sec. 6) holds two chunks in a V (partition.py: stages r and 2pp-1-r) and runs the paper's order (_zbv).
   1F1B puts a Comm between that forward and backward
   (Megatron's send_forward_recv_backward / send_backward_recv_forward); interleaved runs the pair as one
   iteration followed by one send_forward_backward_recv_forward_backward: neighbouring warm-ups differ by
   2 forwards, so what a rank needs in its next pair was made in its neighbours' previous pair, and
   neighbours stay in lockstep whatever the backward/forward cost ratio.
2. *Messages*, placed on a logical clock: every iteration takes one unit and starts as soon as its inputs
   exist (list scheduling). A tensor made in the iteration ending at tick t is exchanged at tick t: the
   sender posts it in the Comm right after, the receiver in its Comm at tick t -- possibly several
   iterations before it needs it (rank 0 takes activations from the last rank early and keeps them).
   Both sides of every pair sit at the same tick, so a rank blocked at tick t only ever waits for a peer
   to reach tick t, and a peer blocked earlier waits on ticks earlier still: no cycle, hence no deadlock
   under NCCL's rendezvous, for any real costs (and for any subset of the messages, e.g. the forward
   half alone). Ops follow tick order, and within a tick the sender's order, so the k-th send A->B always
   meets the k-th recv on B from A (NCCL pairs them without tags; at pp=2 acts and grads share a channel).
   The simpler rule "after compute i, its send plus the recv compute i+1 needs" deadlocks the interleaved
   schedule at pp=2 (a rank blocks sending what its peer asks for only after a forward it still lacks);
   tests/unit/test_pipeline_schedules.py keeps that counter-example.

Left out on purpose: DualPipe, a separate forward-only schedule
(the executor keeps gpipe's forwards and activation messages), overlapping a Comm with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.errors import ConfigError
from megatron_lite.pipeline.partition import stage_owner, virtual_stage

SCHEDULE_CHOICES = ("auto", "gpipe", "1f1b", "interleaved", "zb_h1", "zbv")
SPLIT_BACKWARD = ("zb_h1", "zbv")  # schedules whose backward is B (input gradient) + W (weight gradient)
V_SHAPED = ("zbv",)  # schedules whose stages sit in a V (rank r holds stages r and 2pp-1-r), not in loops


def v_shaped(schedule: str) -> bool:
    """Whether a resolved schedule name places each rank's chunks in a V (partition.py)."""
    return schedule in V_SHAPED


@dataclass(frozen=True)
class Compute:
    kind: str  # "F" (forward), "B" (backward; input gradient only where the schedule has W) or "W" (weight gradient)
    microbatch: int  # 0..m-1, index within this rank's share of the global batch
    chunk: int  # local chunk index 0..vpp-1 on this pipeline rank


@dataclass(frozen=True)
class P2P:
    op: str  # "send" or "recv"
    peer: int  # pipeline rank of the other side
    kind: str  # "act" (forward activation) or "grad" (gradient w.r.t. an activation)
    microbatch: int
    chunk: int  # the LOCAL chunk on THIS rank that produces (send) or consumes (recv) the tensor


@dataclass(frozen=True)
class Comm:
    ops: tuple[P2P, ...]  # posted together as one batch_isend_irecv; all waited before the rank's next step


Step = Compute | Comm


def resolve_schedule(name: str, vpp: int) -> str:
    """`parallel.schedule` -> the schedule that runs: gpipe, 1f1b (vpp == 1) or interleaved (vpp > 1).

    1F1B with several chunks per rank *is* the interleaved schedule, and interleaving one chunk is plain
    1F1B (Megatron's interleaved warm-up would only hold twice the activations for the same bubble).
    zb_h1 runs one chunk per rank.
    """
    if name not in SCHEDULE_CHOICES:
        raise ConfigError(f"parallel.schedule={name} is not a valid choice; use one of {', '.join(SCHEDULE_CHOICES)}")
    if name == "zb_h1" and vpp != 1:
        raise ConfigError(
            f"parallel.schedule=zb_h1 runs one model chunk per pipeline rank, got parallel.vpp={vpp}; "
            "use parallel.vpp=1, or parallel.schedule=interleaved for several chunks"
        )
    if name == "zbv" and vpp != 2:
        raise ConfigError(
            f"parallel.schedule=zbv runs two model chunks per pipeline rank (a V), got "
            f"parallel.vpp={vpp}; use parallel.vpp=2"
        )
    if name in ("gpipe", "zb_h1", "zbv"):
        return name
    return "interleaved" if vpp > 1 else "1f1b"


def group_size(pp: int, m: int) -> int:
    """Micro-batches N that go through one chunk before the next chunk starts (Megatron-Core's
    microbatch_group_size_per_vp_stage): the smallest N >= pp whose last group m % N is 0 or >= pp.

    A group smaller than pp comes back to rank 0 before its previous chunk has left the last rank, and
    with the 1F1B pairing that is a dependency cycle, not just a bubble. So m = 9, pp = 4 runs groups of
    5 + 4 and m = 7, pp = 4 one group of 7; the warm-up (and memory) grows with N instead.
    """
    if m < pp:  # only gpipe accepts this: one group
        return m
    n = pp
    while m % n and m % n < pp:
        n += 1
    return n


def warmup_forwards(name: str, pp: int, vpp: int, m: int, pp_rank: int) -> int:
    """Forwards rank `pp_rank` runs before its first backward (capped at all m*vpp of them).

    1F1B and zb_h1: pp - r - 1, just enough to keep every stage busy until the first gradient comes back.
    Interleaved (Megatron): (pp - r - 1)*2 + (vpp - 1)*N: every rank first pushes one group of N through
    all but its last chunk, then the first gradient needs a round trip, 2 per rank still ahead of it.
    """
    total = m * vpp
    name = resolve_schedule(name, vpp)
    if name == "gpipe":
        return total
    if name in ("1f1b", "zb_h1"):
        return min(pp - pp_rank - 1, total)
    return min((pp - pp_rank - 1) * 2 + (vpp - 1) * group_size(pp, m), total)


def in_flight_bound(name: str, pp: int, vpp: int, m: int, pp_rank: int) -> int:
    """Most forwards whose backward has not run yet that rank `pp_rank` ever holds (activation memory).

    Always min(warmup + 1, m*vpp): the warm-up plus the steady state's one forward. So gpipe: m*vpp;
    1F1B and zb_h1: pp - r; interleaved: min((pp - r - 1)*2 + (vpp - 1)*N + 1, m*vpp), N = group_size (pp when
    pp divides m). zbv: min(2pp, m + 1 + r, 2m) chunk forwards, each half a 1F1B stage's layers: at most
    pp stages' worth on every rank, 1F1B's first-rank bound (Qi et al. 2024, sec. 6).
    """
    if v_shaped(resolve_schedule(name, vpp)):
        return min(2 * pp, m + 1 + pp_rank, 2 * m)
    return min(warmup_forwards(name, pp, vpp, m, pp_rank) + 1, m * vpp)


def held_bound(name: str, pp: int, vpp: int, m: int, pp_rank: int) -> int:
    """Most micro-batches whose forward ran but whose W has not (what their W still needs stays): the
    in-flight bound (zbv runs each W soon after its B), except in zb_h1, where every rank holds min(pp, m),
    1F1B's first-rank bound (rank r runs r (F, B) pairs before its first W)."""
    if resolve_schedule(name, vpp) == "zb_h1":
        return min(pp, m)
    return in_flight_bound(name, pp, vpp, m, pp_rank)


def forward_table(pp: int, vpp: int, m: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order every rank runs its forwards."""
    n, table = group_size(pp, m), []
    for first in range(0, m, n):
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(first, min(first + n, m))]
    return table


def iterations(name: str, pp: int, vpp: int, m: int, pp_rank: int) -> list[tuple[Compute, ...]]:
    """Rank `pp_rank`'s computations in order, grouped into the iterations that run between Comms."""
    name = resolve_schedule(name, vpp)
    if name == "zb_h1":
        return _zb_h1(pp, m, pp_rank)
    if name == "zbv":
        return _zbv(pp, m, pp_rank)
    table = forward_table(pp, vpp, m)
    forwards = [Compute("F", mb, chunk) for mb, chunk in table]
    backwards = [Compute("B", mb, vpp - 1 - chunk) for mb, chunk in table]
    total, warmup = len(table), warmup_forwards(name, pp, vpp, m, pp_rank)
    its: list[tuple[Compute, ...]] = [(f,) for f in forwards[:warmup]]  # warm-up: forwards only
    for i in range(total - warmup):  # steady state: one forward, one backward
        pair = (forwards[warmup + i], backwards[i])
        its += [pair] if name == "interleaved" else [pair[:1], pair[1:]]
    its += [(b,) for b in backwards[total - warmup :]]  # cool-down: the backwards still owed
    return its


def _zb_h1(pp: int, m: int, r: int) -> list[tuple[Compute, ...]]:
    """ZB-H1 on rank r, each computation an iteration of its own (module docstring):
      warm-up    pp-1-r forwards                   (as 1F1B)
      pairs      r x (F, B)                        W's held back: they fill the end of the schedule
      steady     m-pp+1 x (F, B, W)
      cool-down  pp-1-r x (B, W), then r lone W's  the r held W's run where 1F1B idles
    With F = B = W in cost the bubble is (pp-1)/(3m), a third of 1F1B's (simulate.expected_bubble)."""
    forwards = iter(Compute("F", mb, 0) for mb in range(m))
    backs = iter(Compute("B", mb, 0) for mb in range(m))
    weights = iter(Compute("W", mb, 0) for mb in range(m))
    warmup = min(pp - 1 - r, m)
    order = [next(forwards) for _ in range(warmup)]
    order += [s for _ in range(min(r, m - warmup)) for s in (next(forwards), next(backs))]
    order += [s for _ in range(m - warmup - min(r, m - warmup)) for s in (next(forwards), next(backs), next(weights))]
    order += [s for b in backs for s in (b, next(weights))]
    order += list(weights)
    return [(s,) for s in order]


def _zbv(pp: int, m: int, r: int) -> list[tuple[Compute, ...]]:
    """ZB-V on rank r (Qi et al. 2024, sec. 6), chunk a = stage r, chunk b = stage 2pp-1-r, each computation
    an iteration of its own:
      warm-up    2(pp-r)-1 F-a; r x (F-b, F-a); pp-r x (F-b, B-b, W-b)   the V fills, b's first backwards
      steady     (F-a, B-a, W-a, F-b, B-b, W-b) while forwards are left
      cool-down  r x (B-a, B-b); pp-r x (B-a, W-a); the W's still owed, b's then a's
    A phase takes only what exists: with m < 2pp-1 micro-batches the warm-up is cut short and the steady
    state never starts. Every count is the paper's; F = B = W makes the bubble (pp-1)(f+b_in-2w)/(m(f+b))
    ~ 0 (simulate.expected_bubble)."""
    todo = {(kind, chunk): iter(range(m)) for kind in "FBW" for chunk in (0, 1)}
    order: list[Compute] = []

    def run(*names: str) -> None:  # "Fa" -> the next forward of chunk a, if any is left
        for name in names:
            mb = next(todo[(name[0], "ab".index(name[1]))], None)
            if mb is not None:
                order.append(Compute(name[0], mb, "ab".index(name[1])))

    def left(name: str) -> int:
        return m - sum(1 for s in order if (s.kind, s.chunk) == (name[0], "ab".index(name[1])))

    run(*["Fa"] * (2 * (pp - r) - 1))
    for _ in range(r):
        run("Fb", "Fa")
    for _ in range(pp - r):
        run("Fb", "Bb", "Wb")
    while left("Fa") or left("Fb"):
        run("Fa", "Ba", "Wa", "Fb", "Bb", "Wb")
    for _ in range(r):
        run("Ba", "Bb")
    for _ in range(pp - r):
        run("Ba", "Wa")
    while left("Ba") or left("Bb"):
        run("Ba", "Bb")
    run(*["Wb"] * left("Wb"), *["Wa"] * left("Wa"))
    return [(s,) for s in order]


# --- messages: what a computation sends and what it needs ---------------------------------------------


def neighbour(pp_rank: int, pp: int, vpp: int, chunk: int, step: int, v_shape: bool = False) -> tuple[int, int] | None:
    """(pp_rank, chunk) holding the virtual stage `step` (+1 or -1) away from this chunk's; None past an end."""
    v = virtual_stage(pp_rank, chunk, pp, v_shape) + step
    return stage_owner(v, pp, v_shape) if 0 <= v < pp * vpp else None


def _message(
    op: str, kind: str, pp_rank: int, pp: int, vpp: int, step: Compute, direction: int, v_shape: bool
) -> P2P | None:
    other = neighbour(pp_rank, pp, vpp, step.chunk, direction, v_shape)
    if other is None or other[0] == pp_rank:  # an end of the pipeline, or handed over in memory on this rank
        return None
    return P2P(op, other[0], kind, step.microbatch, step.chunk)


def send_forward(pp_rank: int, pp: int, vpp: int, step: Compute, v_shape: bool = False) -> P2P | None:
    """The activation a forward hands to the next virtual stage (none on the last, or when it is on this rank:
    pp=1, or a V's turn)."""
    return _message("send", "act", pp_rank, pp, vpp, step, 1, v_shape)


def recv_forward(pp_rank: int, pp: int, vpp: int, step: Compute, v_shape: bool = False) -> P2P | None:
    """The activation a forward needs from the previous virtual stage (none on stage 0: it reads data)."""
    return _message("recv", "act", pp_rank, pp, vpp, step, -1, v_shape)


def send_backward(pp_rank: int, pp: int, vpp: int, step: Compute, v_shape: bool = False) -> P2P | None:
    """The input-gradient a backward hands to the previous virtual stage (none on stage 0)."""
    return _message("send", "grad", pp_rank, pp, vpp, step, -1, v_shape)


def recv_backward(pp_rank: int, pp: int, vpp: int, step: Compute, v_shape: bool = False) -> P2P | None:
    """The output-gradient a backward needs from the next virtual stage (none on the last: the loss)."""
    return _message("recv", "grad", pp_rank, pp, vpp, step, 1, v_shape)


def matching_recv(pp_rank: int, pp: int, vpp: int, send: P2P, v_shape: bool = False) -> P2P:
    """The recv that `send` (posted by pp_rank) must meet on its peer, named in the peer's chunk."""
    _, chunk = neighbour(pp_rank, pp, vpp, send.chunk, 1 if send.kind == "act" else -1, v_shape)
    return P2P("recv", pp_rank, send.kind, send.microbatch, chunk)


def _ticks(its: list[list[tuple[Compute, ...]]], pp: int, vpp: int, v_shape: bool) -> list[list[int]]:
    """Logical start tick of every iteration: one unit each, started once its inputs from other ranks
    exist. (A backward's own forward is on the same rank and earlier in its order: not a message.)"""
    last, done = pp * vpp - 1, {}  # done[(kind, mb, v)] = tick its iteration ends
    ticks: list[list[int]] = [[] for _ in range(pp)]
    free, progress = [0] * pp, True
    while progress:
        progress = False
        for rank in range(pp):
            while len(ticks[rank]) < len(its[rank]):
                it, deps = its[rank][len(ticks[rank])], []
                for s in it:
                    v = virtual_stage(rank, s.chunk, pp, v_shape)
                    if s.kind == "F" and v > 0:
                        deps.append(("F", s.microbatch, v - 1))
                    if s.kind == "B" and v < last:  # W waits only on its own B, on this rank
                        deps.append(("B", s.microbatch, v + 1))
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] for d in deps])
                ticks[rank].append(start)
                free[rank] = start + 1
                done.update({(s.kind, s.microbatch, virtual_stage(rank, s.chunk, pp, v_shape)): start + 1 for s in it})
                progress = True
    assert all(len(t) == len(i) for t, i in zip(ticks, its)), "iterations wait on each other in a cycle"
    return ticks


def place_comms(its: list[list[tuple[Compute, ...]]], pp: int, vpp: int, v_shape: bool = False) -> list[list[Step]]:
    """Flatten iterations into steps with Comm steps between them (module docstring, pass 2)."""
    if pp == 1:  # one rank: chunks hand tensors over in memory, nothing to send
        return [[s for it in rank_its for s in it] for rank_its in its]
    ticks = _ticks(its, pp, vpp, v_shape)
    # comms[rank][g]: (sort key, op) for the Comm before iteration g (g == len: after the last one)
    comms: list[list[list[tuple[tuple, P2P]]]] = [[[] for _ in range(len(r) + 1)] for r in its]
    for src in range(pp):
        for i, it in enumerate(its[src]):
            for step in it:
                if step.kind == "W":  # weight gradients stay on the rank
                    continue
                send = (send_forward if step.kind == "F" else send_backward)(src, pp, vpp, step, v_shape)
                if send is None:
                    continue
                tick, dst, recv = ticks[src][i] + 1, send.peer, matching_recv(src, pp, vpp, send, v_shape)
                g = sum(1 for t in ticks[dst] if t < tick)  # dst's Comm at `tick`
                consumer = Compute("F" if recv.kind == "act" else "B", recv.microbatch, recv.chunk)
                assert (recv_forward if consumer.kind == "F" else recv_backward)(
                    dst, pp, vpp, consumer, v_shape
                ) == recv
                assert all(consumer not in it for it in its[dst][:g]), "a tensor must arrive before its use"
                comms[src][i + 1].append(((0, tick, src), send))
                comms[dst][g].append(((1, tick, src), recv))
    schedule = []
    for rank in range(pp):
        steps: list[Step] = []
        for g in range(len(its[rank]) + 1):
            if comms[rank][g]:  # sends, then recvs by tick and sender; the sort is stable for ties
                steps.append(Comm(tuple(op for _, op in sorted(comms[rank][g], key=lambda item: item[0]))))
            if g < len(its[rank]):
                steps += its[rank][g]
        schedule.append(steps)
    return schedule


def build_schedule(name: str, pp: int, vpp: int, m: int, v_shape: bool | None = None) -> list[list[Step]]:
    """One ordered list of steps per pipeline rank; `name` as in parallel.schedule (auto allowed). v_shape:
    the stages sit in a V (partition.py); by default only for zbv (evaluation runs gpipe's forwards on a V)."""
    resolved = resolve_schedule(name, vpp)
    v_shape = v_shaped(resolved) if v_shape is None else v_shape
    if m < 1:
        raise ConfigError(
            f"parallel.schedule={name} needs at least 1 micro-batch per step, got {m}; raise train.global_batch_size"
        )
    if resolved != "gpipe" and m < pp:
        raise ConfigError(
            f"parallel.schedule={name} needs at least parallel.pp={pp} micro-batches per step on each pipeline, "
            f"got {m} (train.global_batch_size / (train.micro_batch_size * dp)); raise train.global_batch_size, "
            "lower train.micro_batch_size, or use parallel.schedule=gpipe"
        )
    return place_comms([iterations(resolved, pp, vpp, m, r) for r in range(pp)], pp, vpp, v_shape)
