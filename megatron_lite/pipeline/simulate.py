"""Run every rank's schedule together in one process: catch hangs and misordering, measure the bubble.

Semantics mirror NCCL batched point-to-point (what the executor uses):
- a rank runs its steps in order; a `Comm` posts all its ops at once and the rank waits until every op
  has its partner posted on the peer (a send waits for the recv, as a large NCCL send does);
- there are no tags: the k-th send A->B pairs with the k-th recv on B from A, so a pair whose kind,
  micro-batch or virtual stage disagree would silently deliver the wrong tensor -- here it is an error;
- a `Compute` needs its input already here: data (forward of stage 0), the loss (backward of the last
  stage), a tensor received earlier, or with pp=1 the neighbouring chunk's result in memory.
Time: forwards take f_cost, backwards b_cost, messages nothing. Where a schedule splits the backward, B (input
gradient) takes b_cost - w_cost and W (weight gradient) w_cost, so every schedule does the same work. Ideal
time per rank is m*vpp*(f+b): each chunk computation counts one unit whatever vpp, so the bubble is
(makespan - ideal) / ideal.

Every failure raises ScheduleError whose message ends with the rank x time grid of what ran, so the
broken spot is visible. Left out on purpose: communication cost, memory of received tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.pipeline.partition import stage_owner, virtual_stage
from megatron_lite.pipeline.schedules import (
    P2P,
    Comm,
    Compute,
    Step,
    held_bound,
    in_flight_bound,
    resolve_schedule,
    v_shaped,
)


class ScheduleError(RuntimeError):
    """A schedule that would hang, misorder or corrupt a real run; the message carries the grid."""


@dataclass(frozen=True)
class Event:
    start: float
    end: float
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int


@dataclass
class SimResult:
    pp: int
    vpp: int
    m: int
    f_cost: float
    b_cost: float
    timelines: list[list[Event]]  # per pipeline rank, in execution order
    makespan: float
    peak_in_flight: list[int]  # per rank: most forwards held before their backward ran
    peak_held: list[int]  # per rank: most forwards whose W had not run (their B, where there is no W)
    notes: dict[int, str] = field(default_factory=dict)  # per rank, shown at the end of its grid row

    @property
    def ideal(self) -> float:
        return self.m * self.vpp * (self.f_cost + self.b_cost)

    @property
    def bubble(self) -> float:
        return (self.makespan - self.ideal) / self.ideal


def expected_bubble(
    name: str, pp: int, vpp: int, m: int, f_cost: float = 1.0, b_cost: float = 2.0, w_cost: float | None = None
) -> float:
    """Bubble our schedules reach in this simulator, for any forward/backward cost ratio (the costs matter
    only to zb_h1).

    1F1B: (pp-1)/m. Interleaved: (pp-1)/(vpp*m) (Narayanan et al. 2021, eq. 2), also when pp does not
    divide m, thanks to Megatron's micro-batch groups (schedules.group_size). gpipe walks the same table,
    so it gets (pp-1)/(vpp*m) too, at m*vpp activations held; with m < pp each of its vpp loops through
    the ranks also idles pp-m units: (vpp*(pp-m) + m-1) / (vpp*m).
    zb_h1: (pp-1)(f + b_in - w) / (m (f + b)) with b_in = b - w (Qi et al. 2024, sec. 3.1): of the
    (pp-1)(f+b) idle time of 1F1B, each rank fills (pp-1)w with held W's. With F = B = W: (pp-1)/(3m).
    Only while b_in + f >= w (else a rank waits on W's it has not got): the paper's costs all pass.
    zbv, for m >= 2pp-1 with F = B = W: (pp-1)/(6m), the last rank's wait for the first forward (f/vpp per
    rank of the V), a sixth of 1F1B's; written (pp-1)(f + b_in - w) / (vpp m (f + b)) as zb_h1's over vpp.
    """
    name = resolve_schedule(name, vpp)
    if name in ("zb_h1", "zbv"):
        w_cost = b_cost / 2 if w_cost is None else w_cost
        return (pp - 1) * (f_cost + b_cost - 2 * w_cost) / (vpp * m * (f_cost + b_cost))
    if name == "1f1b":
        return (pp - 1) / m
    if name == "gpipe" and m < pp:
        return (vpp * (pp - m) + m - 1) / (vpp * m)
    return (pp - 1) / (vpp * m)


def label(kind: str, microbatch: int, chunk: int, vpp: int) -> str:
    """Grid cell text: F3 with one chunk per rank, F3a / F3b ... (chunk 0, 1, ...) with several."""
    if vpp == 1:
        return f"{kind}{microbatch}"
    return f"{kind}{microbatch}{chr(ord('a') + chunk)}" if vpp <= 26 else f"{kind}{microbatch}.{chunk}"


def describe(step: Step, vpp: int) -> str:
    if isinstance(step, Compute):
        return label(step.kind, step.microbatch, step.chunk, vpp)
    arrows = {"send": "->", "recv": "<-"}
    return (
        "Comm["
        + ", ".join(
            f"{op.op} {op.kind} {label('', op.microbatch, op.chunk, vpp)} {arrows.get(op.op, '?')} rank {op.peer}"
            for op in step.ops
        )
        + "]"
    )


def render_grid(
    result_or_schedule: SimResult | list[list[Step]], vpp: int | None = None, unit: float | None = None
) -> str:
    """Rank x time text grid. A SimResult gets one column per `unit` of time (default: the cheaper
    computation), `.` when idle, `~` while a long computation continues; a bare schedule gets its
    computations in order, one per column (no timing)."""
    if isinstance(result_or_schedule, SimResult):
        res = result_or_schedule
        unit = unit or min(res.f_cost, res.b_cost)
        n_cols = max(1, round(res.makespan / unit))
        rows = []
        for events in res.timelines:
            cells = ["."] * n_cols
            for e in events:
                first, last = round(e.start / unit), max(round(e.end / unit), round(e.start / unit) + 1)
                cells[first:last] = [label(e.kind, e.microbatch, e.chunk, res.vpp)] + ["~"] * (last - first - 1)
            rows.append(cells[:n_cols])
        notes = res.notes
    else:
        vpp = vpp or 1 + max((s.chunk for row in result_or_schedule for s in row if isinstance(s, Compute)), default=0)
        rows = [
            [label(s.kind, s.microbatch, s.chunk, vpp) for s in row if isinstance(s, Compute)]
            for row in result_or_schedule
        ]
        n_cols, notes = max((len(r) for r in rows), default=0), {}
    width = max([len(c) for r in rows for c in r] + [len(str(n_cols - 1)), 1]) + 1
    lines = ["time   | " + "".join(str(t).ljust(width) for t in range(n_cols))]
    for rank, cells in enumerate(rows):
        note = f"  <- {notes[rank]}" if rank in notes else ""
        lines.append(f"rank {rank:<2}| " + "".join(c.ljust(width) for c in cells).rstrip() + note)
    return "\n".join(lines)


class _Rank:
    """What one pipeline rank has done so far."""

    def __init__(self) -> None:
        self.pc = 0  # index of the next step
        self.clock = 0.0
        self.posted = -1  # index of the Comm step whose ops are posted
        self.slots: list[tuple[tuple[int, int], str, int]] = []  # ((src, dst), side, index) per posted op
        self.done: dict[str, set[tuple[int, int]]] = {"F": set(), "B": set(), "W": set()}
        self.inbox: dict[tuple[str, int, int], float] = {}  # (kind, mb, chunk) -> time it arrived
        self.timeline: list[Event] = []
        self.in_flight = self.peak = 0
        self.held = self.peak_held = 0


class _Simulator:
    def __init__(self, schedule, pp, vpp, m, f_cost, b_cost, w_cost, v_shape):
        if len(schedule) != pp:
            raise ScheduleError(
                f"the schedule has {len(schedule)} rank lists, expected pp={pp}\n{render_grid(schedule, vpp)}"
            )
        self.schedule, self.pp, self.vpp, self.m, self.v_shape = schedule, pp, vpp, m, v_shape
        self.split = any(isinstance(s, Compute) and s.kind == "W" for row in schedule for s in row)
        self.b_cost = b_cost
        self.cost = {"F": f_cost, "B": b_cost - w_cost, "W": w_cost} if self.split else {"F": f_cost, "B": b_cost}
        self.ranks = [_Rank() for _ in range(pp)]
        # (src, dst) -> {"send": [...], "recv": [...]}, entries (post time, message, text)
        self.channels: dict[tuple[int, int], dict[str, list[tuple[float, tuple, str]]]] = {}

    def result(self, notes: dict[int, str] | None = None) -> SimResult:
        timelines = [r.timeline for r in self.ranks]
        makespan = max((e.end for t in timelines for e in t), default=0.0)
        return SimResult(
            self.pp,
            self.vpp,
            self.m,
            self.cost["F"],
            self.b_cost,
            timelines,
            makespan,
            [r.peak for r in self.ranks],
            [r.peak_held for r in self.ranks],
            notes or {},
        )

    def fail(self, why: str, notes: dict[int, str] | None = None) -> None:
        raise ScheduleError(f"{why}\n{render_grid(self.result(notes))}")

    # --- messages ---

    def message(self, rank: int, op: P2P) -> tuple:
        """(kind, micro-batch, producing virtual stage) that `op` carries; checks stage and peer."""
        pp, last, v = self.pp, self.pp * self.vpp - 1, virtual_stage(rank, op.chunk, self.pp, self.v_shape)
        where = f"rank {rank}: {op.op} {op.kind} of micro-batch {op.microbatch}, chunk {op.chunk}"
        if op.op not in ("send", "recv") or op.kind not in ("act", "grad") or not 0 <= op.chunk < self.vpp:
            self.fail(f"{where} is not a valid P2P op")
        step = 1 if op.kind == "act" else -1  # activations flow to v+1, gradients to v-1
        src = v if op.op == "send" else v - step
        dst = src + step
        if not (0 <= src <= last and 0 <= dst <= last):
            self.fail(f"{where}: virtual stage {v} has no such neighbour")
        peer, _ = stage_owner(dst if op.op == "send" else src, pp, self.v_shape)
        if op.peer != peer:
            self.fail(f"{where} names rank {op.peer}, but the other virtual stage lives on rank {peer}")
        if op.op == "send" and (op.microbatch, op.chunk) not in self.ranks[rank].done["F" if step == 1 else "B"]:
            self.fail(f"{where}: that tensor has not been computed yet")
        return op.kind, op.microbatch, src

    def post(self, rank: int, comm: Comm) -> None:
        state = self.ranks[rank]
        state.posted, state.slots = state.pc, []
        for op in comm.ops:
            msg = self.message(rank, op)
            key = (rank, op.peer) if op.op == "send" else (op.peer, rank)
            chan = self.channels.setdefault(key, {"send": [], "recv": []})
            chan[op.op].append((state.clock, msg, f"rank {rank} {describe(Comm((op,)), self.vpp)}"))
            index = len(chan[op.op]) - 1
            state.slots.append((key, op.op, index))
            if index < len(chan["send"]) and index < len(chan["recv"]):
                (_, sent, stext), (_, wanted, rtext) = chan["send"][index], chan["recv"][index]
                if sent != wanted:  # NCCL would hand over the wrong tensor without a word
                    self.fail(
                        f"message {index} from rank {key[0]} to rank {key[1]} is mismatched: {stext} pairs with {rtext}"
                    )

    def try_complete(self, rank: int, comm: Comm) -> bool:
        state, done_at = self.ranks[rank], self.ranks[rank].clock
        for key, side, index in state.slots:  # one slot per op of comm
            other = self.channels[key]["recv" if side == "send" else "send"]
            if index >= len(other):
                return False  # the partner is not posted yet
            done_at = max(done_at, other[index][0])
        state.clock = done_at
        for op in comm.ops:
            if op.op == "recv":
                state.inbox[(op.kind, op.microbatch, op.chunk)] = done_at
        return True

    # --- computations ---

    def compute(self, rank: int, step: Compute) -> None:
        state, pp, last = self.ranks[rank], self.pp, self.pp * self.vpp - 1
        kind, mb, chunk = step.kind, step.microbatch, step.chunk
        name = f"rank {rank} step {state.pc} {describe(step, self.vpp)}"
        if kind not in self.cost or not (0 <= mb < self.m and 0 <= chunk < self.vpp):
            self.fail(f"{name}: not a valid computation for m={self.m}, vpp={self.vpp}")
        if (mb, chunk) in state.done[kind]:
            self.fail(f"{name} runs a second time")
        if kind == "B" and (mb, chunk) not in state.done["F"]:
            self.fail(f"{name}: backward before its forward")
        if kind == "W" and (mb, chunk) not in state.done["B"]:
            self.fail(f"{name}: weight gradient before its input gradient (B)")
        if kind == "W":  # its inputs are this rank's own B's
            self.finish(state, Event(state.clock, state.clock + self.cost["W"], kind, mb, chunk))
            return
        v, ready = virtual_stage(rank, chunk, pp, self.v_shape), state.clock
        from_outside = v == 0 if kind == "F" else v == last  # the data / the loss: always at hand
        owner, neighbour = (
            stage_owner(v - 1 if kind == "F" else v + 1, pp, self.v_shape) if not from_outside else (-1, -1)
        )
        if owner == rank:  # the neighbouring chunk on this rank hands it over in memory (pp=1, a V's turn)
            if (mb, neighbour) not in state.done[kind]:
                self.fail(f"{name}: chunk {neighbour} has not produced its input yet")
        elif not from_outside:
            inbox_key = ("act" if kind == "F" else "grad", mb, chunk)
            if inbox_key not in state.inbox:
                self.fail(f"{name}: its input ({inbox_key[0]}) was never received before it")
            ready = max(ready, state.inbox.pop(inbox_key))
        self.finish(state, Event(ready, ready + self.cost[kind], kind, mb, chunk))

    def finish(self, state: _Rank, event: Event) -> None:
        state.timeline.append(event)
        state.clock = event.end
        state.done[event.kind].add((event.microbatch, event.chunk))
        state.in_flight += {"F": 1, "B": -1, "W": 0}[event.kind]
        state.peak = max(state.peak, state.in_flight)
        state.held += 1 if event.kind == "F" else -1 if event.kind == ("W" if self.split else "B") else 0
        state.peak_held = max(state.peak_held, state.held)

    def advance(self, rank: int) -> bool:
        """Run rank's next step if it can; False when it is finished or blocked."""
        state, steps = self.ranks[rank], self.schedule[rank]
        if state.pc >= len(steps):
            return False
        step = steps[state.pc]
        if isinstance(step, Compute):
            self.compute(rank, step)
        elif isinstance(step, Comm):
            if state.posted != state.pc:
                self.post(rank, step)
            if not self.try_complete(rank, step):
                return False
        else:
            self.fail(f"rank {rank} step {state.pc} is neither Compute nor Comm: {step!r}")
        state.pc += 1
        return True

    def run(self, name: str | None) -> SimResult:
        progress = True
        while progress:
            progress = False
            for rank in range(self.pp):
                while self.advance(rank):
                    progress = True
        stuck = {
            r: f"blocked at step {s.pc}: {describe(self.schedule[r][s.pc], self.vpp)}"
            for r, s in enumerate(self.ranks)
            if s.pc < len(self.schedule[r])
        }
        if stuck:
            self.fail("deadlock: every unfinished rank waits for a partner that never posts", stuck)
        everything = {(mb, c) for mb in range(self.m) for c in range(self.vpp)}
        for rank, state in enumerate(self.ranks):
            for kind in self.cost:
                missing = sorted(everything - state.done[kind])
                if missing:
                    self.fail(f"rank {rank} never runs {kind} of (micro-batch, chunk) {missing[:4]}")
            if state.inbox:
                self.fail(f"rank {rank} received tensors it never used: {sorted(state.inbox)[:4]}")
        result = self.result()
        if name is not None:
            for rank, (peak, held) in enumerate(zip(result.peak_in_flight, result.peak_held)):
                bound = in_flight_bound(name, self.pp, self.vpp, self.m, rank)
                if peak > bound:
                    self.fail(
                        f"rank {rank} holds {peak} forwards awaiting their backward, above the {name} bound of {bound}",
                        {rank: f"peak {peak} > {bound}"},
                    )
                bound = held_bound(name, self.pp, self.vpp, self.m, rank)
                if held > bound:
                    self.fail(
                        f"rank {rank} holds {held} forwards awaiting their weight gradient, above the "
                        f"{name} bound of {bound}",
                        {rank: f"held {held} > {bound}"},
                    )
        return result


def simulate(
    schedule: list[list[Step]],
    pp: int,
    vpp: int,
    m: int,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    name: str | None = None,
    w_cost: float | None = None,
    v_shape: bool | None = None,
) -> SimResult:
    """Run all ranks' step lists together; raise ScheduleError on any hang or inconsistency.

    b_cost is the whole backward; a schedule with W steps spends w_cost of it (default half) in W.
    `name` (a parallel.schedule value) also checks the peak in-flight activations against
    schedules.in_flight_bound (and held_bound) for that schedule. v_shape: the stages sit in a V
    (partition.py); by default, when `name` is zbv.
    """
    w_cost = b_cost / 2 if w_cost is None else w_cost
    if v_shape is None:
        v_shape = name is not None and v_shaped(resolve_schedule(name, vpp))
    return _Simulator(schedule, pp, vpp, m, f_cost, b_cost, w_cost, v_shape).run(name)
