"""A rank made slow from outside (stopped and continued on a duty cycle: SIGSTOP / SIGCONT, nothing in the
product) is named, with its host, within the stated number of reports; an even run warns of nothing; and
faults.straggler_action=stop checkpoints, exits 5 with straggler.json, and resumes exactly (2 ranks, dp 2)."""

import contextlib
import json
import os
import signal
import socket
import threading
import time

import pytest

from tests.distributed.common import logged_records, max_abs_diff
from tests.distributed.common import overrides as base_overrides
from tests.distributed.launcher import clean_shared_memory
from tests.distributed.test_signals import launch, workers

# A report spans many duty cycles (below): with a 0.2 s cycle and a report every 2 steps of ~0.1-0.2 s, the cycle
# aliased with the reports and their ratios swung between 1.0 and 2.4, and the 3 in a row came late or not at all
LOG_INTERVAL, INTERVALS = 6, 3
STEPS = 10 * LOG_INTERVAL
WATCH = [
    f"train.log_interval={LOG_INTERVAL}",
    "faults.straggler_ratio=1.5",
    f"faults.straggler_intervals={INTERVALS}",
]
# The slow rank's duty cycle: 70% of its time stopped. Stopped half the time, its reports measured 1.47-2.2 against
# the 1.5 threshold, and one report under it in third place put the naming 6 reports in, past the stated bound
STOPPED_S, RUNNING_S = 0.07, 0.03


def rank_pid(pids: list[int], rank: int) -> int:
    """Which of these processes is global rank `rank` (its environment's RANK)."""
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no process of {pids} has RANK={rank}")


@contextlib.contextmanager
def duty_cycle(pid: int):
    """Process `pid` stopped and continued in turn (STOPPED_S, RUNNING_S) while the block runs; continued after."""
    done = threading.Event()

    def cycle():
        while not done.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(STOPPED_S)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            time.sleep(RUNNING_S)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _train(tmp_path, name: str, *extra: str, slow_rank: int | None = None) -> tuple[int, str]:
    """torchrun on 2 ranks; with slow_rank, that rank is stopped and continued until the job ends. Returns the
    exit code and the output (stdout and stderr)."""
    proc = launch(base_overrides(tmp_path, name, *WATCH, *extra))
    try:
        slowed = duty_cycle(rank_pid(workers(proc), slow_rank)) if slow_rank is not None else contextlib.nullcontext()
        with slowed:
            out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        clean_shared_memory()
    return proc.returncode, out + err


def _warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if "straggler" in line]


def test_a_rank_slowed_from_outside_is_named_within_the_stated_reports(tmp_path):
    """The first report that measures anything is the one at step LOG_INTERVAL (the first step is warm-up, not
    counted); the slow rank must be named by INTERVALS reports later, with two noisy reports allowed."""
    code, out = _train(tmp_path, "slow", f"train.steps={STEPS}", slow_rank=1)
    assert code == 0, out[-3000:]
    named = [line for line in _warnings(out) if line.startswith("warning:")]
    host = socket.gethostname()
    assert named and f"rank 1 (host {host}, local rank 1) is a straggler" in named[0], out[-3000:]
    step = int(named[0].split("at step ")[1].split(",")[0])
    assert step <= LOG_INTERVAL * (INTERVALS + 2), (step, named)
    reports = [r for r in logged_records(f"{tmp_path}/slow") if "slowest_rank" in r and r["step"] > LOG_INTERVAL]
    assert len(reports) == STEPS // LOG_INTERVAL - 1 and all(r["step"] % LOG_INTERVAL == 0 for r in reports)
    assert sum(r["slowest_rank"] == 1 and r["slowest_ratio"] > 1.5 for r in reports) >= 0.8 * len(reports), reports


@pytest.mark.slow
def test_an_even_run_warns_of_nothing_and_stop_checkpoints_and_resumes_exactly(tmp_path):
    steps = f"train.steps={STEPS}"
    code, out = _train(tmp_path, "even", steps)
    assert code == 0 and not _warnings(out), out[-3000:]
    even = {r["step"]: r["loss"] for r in logged_records(f"{tmp_path}/even")}
    assert max(r["slowest_ratio"] for r in logged_records(f"{tmp_path}/even") if "slowest_ratio" in r) < 1.5

    code, out = _train(tmp_path, "stop", steps, "faults.straggler_action=stop", slow_rank=1)
    # every rank exits 5 (srun, and so slurm/train.sbatch, passes that on; torchrun ends with 1 and lists it)
    assert code != 0 and out.count("exitcode  : 5") == 2, out[-3000:]
    with open(f"{tmp_path}/stop/straggler.json") as f:
        named = json.load(f)
    assert (named["rank"], named["host"], named["local_rank"]) == (1, socket.gethostname(), 1), named
    saved = named["step"]
    assert saved < STEPS and f"straggler: at step {saved}, rank 1" in out, out[-3000:]
    assert os.path.isfile(f"{tmp_path}/stop/checkpoints/step_{saved:07d}/meta.json")

    code, out = _train(tmp_path, "stop", steps, "checkpoint.resume=auto")  # the rank is well again
    assert code == 0, out[-3000:]
    resumed = {r["step"]: r["loss"] for r in logged_records(f"{tmp_path}/stop")}
    every = list(range(1, STEPS + 1))
    assert sorted(resumed) == every
    assert max_abs_diff([resumed[s] for s in every], [even[s] for s in every]) <= 1e-6
