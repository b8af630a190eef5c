"""Naming a slow rank: each rank's busy time per step, compared across the ranks every train.log_interval steps.

At scale one slow GPU or host (thermal throttling, a bad NIC, a noisy neighbour) slows every rank, because every
collective waits for it; the job only looks slow. What tells the slow rank apart is its *busy* time: its step
time less the time it spent inside collectives and point-to-point waits. The others wait for it there, so their
busy time stays what it was while its own grows.

- `CollectiveClock` times every torch.distributed call this process makes (DeepSpeed's go through them too; it
  is installed before the engine is built, as DeepSpeed keeps references to some of them): wall clock on the
  CPU; on a GPU, CUDA events around each call on the current stream, read once the step has synchronized (the
  time the stream spends in a collective, waiting for peers included). A collective DeepSpeed overlaps on a side
  stream (overlap_comm) is not seen there: only its wait on the compute stream is, inside the busy time.
- `StragglerWatch` adds each step's busy time up (not the run's first step: warm-up and compilation) and, every
  train.log_interval steps, gathers it from every rank in one all-reduce of world-size floats (no store writes).
  The slowest rank and its ratio to the median rank's (the lower median: with 2 ranks, the other one) go to
  metrics.jsonl, the console and wandb (which also gets every rank's busy time). When the same rank stays above
  faults.straggler_ratio for faults.straggler_intervals reports in a row, the report names it with its host
  (faults/identity.py): `warn` prints a warning, `stop` checkpoints and exits 5.
Every rank gets the same gathered numbers, so every rank takes the same decision without another collective.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.faults import identity

STRAGGLER_EXIT = 5  # the process's exit code after faults.straggler_action=stop (cli.py; slurm/train.sbatch)

# Every torch.distributed call that moves data between ranks and can wait for a peer. Not isend/irecv:
# P2POp checks its op is one of them (our pipeline batches its sends and receives through batch_isend_irecv).
TIMED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "batch_isend_irecv",
)


class _TimedWork:
    """An async collective's handle whose wait() is timed as the call was."""

    def __init__(self, work, clock: CollectiveClock):
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        with self._clock.span():
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveClock:
    """Time this process spends in torch.distributed's collectives and waits, while installed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        for name in TIMED:
            if hasattr(dist, name) and name not in self._originals:
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._timed(self._originals[name]))

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def span(self):
        return _CudaSpan(self) if self.cuda else _WallSpan(self)

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.span():
                out = fn(*args, **kwargs)
            if isinstance(out, list):  # batch_isend_irecv's requests
                return [_TimedWork(w, self) for w in out]
            return _TimedWork(out, self) if out is not None and hasattr(out, "wait") else out

        return timed

    def take(self) -> float:
        """Seconds spent in collectives since the last take (on a GPU: read once the device has synchronized)."""
        if self._events:
            self._events[-1][1].synchronize()  # (the step has; an evaluation or a save before it may not have)
        seconds = self._seconds + sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        self._seconds, self._events = 0.0, []
        return seconds


class _WallSpan:
    def __init__(self, clock: CollectiveClock):
        self.clock = clock

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.clock._seconds += time.perf_counter() - self.t0


class _CudaSpan:
    def __init__(self, clock: CollectiveClock):
        self.clock = clock

    def __enter__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def __exit__(self, *exc):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.clock._events.append((self.start, end))


@dataclass(frozen=True)
class Report:
    busy_s: list[float]  # each rank's busy seconds over the interval, by global rank
    slowest_rank: int
    ratio: float  # the slowest rank's busy time over the median rank's
    flagged: bool  # the same rank has stayed above the ratio for the set number of reports in a row, this one last
    streak: int  # reports in a row the slowest rank has stayed above the ratio

    def metrics(self) -> dict:
        return {"slowest_rank": self.slowest_rank, "slowest_ratio": self.ratio}

    def message(self, threshold: float, who: identity.RankIdentity | None = None) -> str:
        """The line naming the straggler (`who`: its identity, when the caller has read it already)."""
        who = who or identity.of(self.slowest_rank)
        return (
            f"{who} is a straggler: its busy time (compute, not collective waits) has been over "
            f"faults.straggler_ratio={threshold:g} times the median rank's for {self.streak} reports in a row "
            f"({self.ratio:.2f}x now)"
        )


def judge(
    busy_s: list[float], threshold: float, intervals: int, streak: tuple[int | None, int]
) -> tuple[Report, tuple]:
    """The report on one interval's busy times, given the streak so far as (rank, reports in a row); returns it
    and the new streak."""
    median = statistics.median_low(busy_s)
    slowest = max(range(len(busy_s)), key=lambda r: busy_s[r])
    ratio = busy_s[slowest] / median if median > 0 else 1.0
    rank, count = streak
    if ratio > threshold:
        count = count + 1 if rank == slowest else 1
        rank = slowest
    else:
        rank, count = None, 0
    return Report(busy_s, slowest, ratio, count == intervals, count), (rank, count)


class StragglerWatch:
    """One rank's busy time, gathered and judged every train.log_interval steps (see the module docstring)."""

    def __init__(self, faults, device: torch.device):
        """faults: the config's faults group (straggler_ratio, straggler_intervals, straggler_action)."""
        self.threshold, self.intervals, self.action = (
            faults.straggler_ratio,
            faults.straggler_intervals,
            faults.straggler_action,
        )
        self.device = device
        self.clock = CollectiveClock(device)
        self.clock.install()
        self._busy, self._streak = 0.0, (None, 0)

    def start_step(self) -> None:
        self.clock.take()  # what came before the step (an evaluation, a save) is not its

    def end_step(self, step_s: float, counted: bool = True) -> None:
        """After the step has synchronized: its busy time counts unless `counted` is False (the first step)."""
        waited = self.clock.take()
        if counted:
            self._busy += max(step_s - waited, 0.0)

    def report(self) -> Report:
        """Collective: every rank's busy time since the last report, judged (the same on every rank)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        every = torch.zeros(world, dtype=torch.float64, device=self.device)
        every[rank] = self._busy
        dist.all_reduce(every)
        self.clock.take()  # (the gather's own time is no step's)
        self._busy = 0.0
        report, self._streak = judge(every.tolist(), self.threshold, self.intervals, self._streak)
        return report

    def close(self) -> None:
        self.clock.uninstall()

    def judge(self, step: int, record: dict, logger) -> Report | None:
        """Collective, at a report's step: the slowest rank and its ratio into the step's `record`, every rank's
        busy time to wandb (logger: the run's MetricsLogger), a straggler warned of; returns the report when
        faults.straggler_action=stop calls for a stop (the same on every rank)."""
        report = self.report()
        record.update(report.metrics())
        logger.histogram("rank_busy_s", report.busy_s, step)
        if not report.flagged:
            return None
        if self.action == "stop":
            return report
        logger.print(f"warning: at step {step}, {report.message(self.threshold)}")
        return None

    def say_stopped(self, report: Report, step: int, run_dir: str, logger, is_rank0: bool) -> None:
        """After the stop's checkpoint of `step`: rank 0 says so and leaves run_dir/straggler.json naming the rank
        and its host for the launcher (slurm/train.sbatch requeues the job without that node)."""
        if not is_rank0:
            return
        who = identity.of(report.slowest_rank)
        with open(os.path.join(run_dir, "straggler.json"), "w") as f:
            json.dump({**who.to_json(), "ratio": report.ratio, "step": step}, f)
        logger.print(
            f"straggler: at step {step}, {report.message(self.threshold, who)}; saved and stopped (exit {STRAGGLER_EXIT}); "
            f"resume with checkpoint.resume=auto, without host {who.host} (slurm/train.sbatch requeues leaving it out)"
        )
