"""Long-lived torchrun worlds for run_configs: one per world size, started on first use and kept for the session.

A world's start-up is most of a short trajectory test on two cores: torchrun and every rank import torch,
DeepSpeed and Hydra; the first optimizer imports torch._dynamo and DeepSpeed's first ZeRO engine imports
Inductor (it compiles its Muon kernels on import). That is 6-12 s a world, more than the runs it holds, and the
suite starts dozens. A pool world pays it once: its ranks (tests/distributed/pool_worker.py) wait for request
files and run each one's spec as tests/distributed/worker.py would, in the process group they already have.

The runs of a spec were already trained one after another in one world, so nothing here is new to the code
under test; a run's results depend on nothing a previous run left behind (a leak would show as a trajectory
that no longer matches its reference). Tests that need a fresh world (resume after a restart, faults, another
environment) start their own with torchrun as before. MEGATRON_LITE_TEST_POOL=0 turns the pool off.

A request that fails (a rank raised, a rank died, the timeout passed) ends its world; the error carries the
world's output since the request, and the next request starts a new world.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from tests.distributed.launcher import ROOT, SCRATCH, rank_env, torchrun_cmd

POOL_WORKER = os.path.join(ROOT, "tests", "distributed", "pool_worker.py")
POLL_S = 0.02


def enabled() -> bool:
    return os.environ.get("MEGATRON_LITE_TEST_POOL", "1") != "0"


class World:
    """One torchrun world of `nproc` pool workers. Requests are numbered files in its inbox: <k>.json names a
    spec; the workers answer <k>.done (rank 0, after a barrier: every rank has finished) or <k>.error.<rank>, and
    each rank writes its pid to pid.<rank> when it starts."""

    def __init__(self, nproc: int):
        self.nproc, self.next = nproc, 0
        os.makedirs(SCRATCH, mode=0o755, exist_ok=True)
        self.inbox = os.path.join(SCRATCH, f"pool_{nproc}_{time.monotonic_ns()}")
        os.makedirs(self.inbox)
        self.log_path = os.path.join(self.inbox, "output.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            torchrun_cmd(nproc, POOL_WORKER, self.inbox, str(os.getpid())),
            env=rank_env(),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def submit(self, spec: str) -> tuple[int, int]:
        """Ask the world to train `spec` (worker.py's spec file); returns the request's number and where its output
        starts in the world's log, for `wait`."""
        k, self.next = self.next, self.next + 1
        offset = os.path.getsize(self.log_path)
        request = os.path.join(self.inbox, f"{k}.json")
        with open(request + ".tmp", "w") as f:
            json.dump({"spec": spec}, f)
        os.rename(request + ".tmp", request)  # a worker never reads half a request
        return k, offset

    def wait(self, k: int, offset: int, deadline: float) -> None:
        """Wait for request `k`; raise AssertionError with the world's output since `offset` if it fails."""
        done = os.path.join(self.inbox, f"{k}.done")
        while not os.path.exists(done):
            failed = self._failure(k)
            if failed or time.monotonic() > deadline:
                self.close(force=True)
                why = failed or "no answer in time"
                with open(self.log_path, errors="replace") as f:
                    f.seek(offset)
                    output = f.read()[-8000:]
                raise AssertionError(f"pool world of {self.nproc}: {why}\n{output}")
            time.sleep(POLL_S)

    def _failure(self, k: int) -> str | None:
        errors = sorted(f for f in os.listdir(self.inbox) if f.startswith(f"{k}.error."))
        if errors:
            with open(os.path.join(self.inbox, errors[0])) as f:
                return f"rank {errors[0].rsplit('.', 1)[1]} raised:\n{f.read()}"
        if not self.alive():
            return f"torchrun exited {self.proc.returncode}"
        return None

    def close(self, force: bool = False) -> None:
        if self.alive() and not force:
            stop = os.path.join(self.inbox, f"{self.next}.json")
            with open(stop + ".tmp", "w") as f:
                json.dump({"stop": True}, f)
            os.rename(stop + ".tmp", stop)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                force = True
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.inbox):  # torchrun starts each rank in a session of its own
            if name.startswith("pid."):
                with open(os.path.join(self.inbox, name)) as f:
                    pid = int(f.read())
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()


# (world size, lane): lane 1 is a second one-rank world, so that two one-rank specs train at once on two cores
_worlds: dict[tuple[int, int], World] = {}


def _world(nproc: int, lane: int) -> World:
    world = _worlds.get((nproc, lane))
    if world is None or not world.alive():
        world = _worlds[nproc, lane] = World(nproc)
    return world


def run(nproc: int, specs: list[str], timeout: float) -> None:
    """Train each spec on its own lane's world of `nproc` ranks, all at once; wait for all of them. A failure
    ends the failed world and every other world of this call (what they still run is not waited for)."""
    worlds = [_world(nproc, lane) for lane in range(len(specs))]
    deadline = time.monotonic() + timeout
    started = [(world, *world.submit(spec)) for world, spec in zip(worlds, specs)]
    try:
        for world, k, offset in started:
            world.wait(k, offset, deadline)
    except AssertionError:
        for world in worlds:
            world.close(force=True)
        raise


def close_all() -> None:
    while _worlds:
        _worlds.popitem()[1].close()
