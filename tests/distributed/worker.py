"""Runs several training configs in one torchrun world, one after another in the same processes.

argv[1]: a JSON file holding {"runs": [[override, ...], ...], "out": path}. Rank 0 writes, per run, the
per-step losses and the final summary to `out` as JSON.

Each run must leave the process as it found it: after every run only the default process group is left, with
only its gloo threads (a run that kept its groups, or a DeepSpeed global that kept the run, adds threads that
wake hundreds of times a second: engine/repairs forget_run_in_deepspeed_globals). A run that leaves more
fails here, in whatever test trained it. Except the threads after a compiled run: dynamo installs its compiled
graphs as globals of the compiled function's module (megatron_lite.model.gpt), where they stay after
torch._dynamo.reset(), and the graph of a tensor-parallel block holds its process group (measured: one group's
3 threads left per compiled tp run). Such runs get worlds of their own (launcher.compiles).
"""

import json
import os
import sys
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_lite.cli import exit_process, resolved
from megatron_lite.training import run
from tests.distributed.launcher import compiles


def main(spec_path: str, train=lambda overrides: run(*resolved(overrides))) -> int:
    """train(overrides) -> a run's summary (host_waits_worker.py passes one that also counts)."""
    train_spec(spec_path, train)
    dist.destroy_process_group()
    return 0


def train_spec(spec_path: str, train=lambda overrides: run(*resolved(overrides))) -> None:
    """Train the spec's runs one after another; rank 0 writes their results; a barrier ends it."""
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    for overrides in spec["runs"]:
        results.append({"overrides": overrides, **train(overrides)})
        check_nothing_left(overrides)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()


# torch's gloo process group: a device with one loop thread (gloo_tcp_loop) and two worker threads
# (pt_gloo_runloop, ProcessGroupGloo's default options)
GLOO_THREADS_PER_GROUP = 3


def gloo_threads() -> int:
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return sum(name in ("gloo_tcp_loop", "pt_gloo_runloop") for name in names)


def check_nothing_left(overrides: list[str]) -> None:
    """Raise if the run left a process group besides the default one, or the threads of one. A destroyed group's
    threads are joined, but a joined thread's task can still be listed under /proc for a moment (seen once with 8
    ranks on 2 cores: one thread too many); a leaked thread stays, so the count is taken again for up to 5 s."""
    groups = len(c10d._world.pg_map)
    count = (lambda: gloo_threads()) if dist.get_backend() == "gloo" and not compiles(overrides) else (lambda: 0)
    threads, deadline = count(), time.monotonic() + 5
    while threads > GLOO_THREADS_PER_GROUP * groups and time.monotonic() < deadline:
        time.sleep(0.1)
        threads = count()
    if groups > 1 or threads > GLOO_THREADS_PER_GROUP * groups:
        raise AssertionError(
            f"the run {overrides} left {groups - 1} process groups besides the default one and "
            f"{threads} gloo threads ({GLOO_THREADS_PER_GROUP} are the default group's)"
        )


if __name__ == "__main__":
    exit_process(lambda: main(sys.argv[1]))
