"""Naming the rank that stalled when a collective times out (dist.step_timeout_s, dist.timeout_s).

A timed-out collective tells a rank only that some peer did not answer. So every rank that meets the timeout
says so in the job's key-value store (torchrun's agent serves it; under srun rank 0's process does) and waits
a grace period for the others to say so too: all live ranks block at about the same point, so they time out
within about one timeout of each other. The ranks that never report are the ones that hung or died. Every
rank also notes there the last step it finished (one store write a step: a few microseconds on one host,
one round trip to the store's host otherwise), so the message
says where each of them stopped, and who it is (faults/identity.py: rank, host, local rank). If the store
itself is gone (under srun, when rank 0 is the one that hung or
died), the message says that instead.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import torch.distributed as dist

from megatron_lite.faults import identity

_PREFIX = "megatron_lite/stalls"


def note_step(step: int) -> None:
    """Record that this rank finished `step`."""
    identity.job_store().set(f"{_PREFIX}/step/{dist.get_rank()}", str(step))


# What a timed-out collective says, and nothing else: gloo's transport ("[.../gloo/transport/tcp/
# unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", then "Application timeout caused
# pair closure" from the next collective on the same pair) and NCCL's watchdog ("Watchdog caught collective
# operation timeout: WorkNCCL(...) ran for ... milliseconds before timing out", also inside the "NCCL communicator
# was aborted" error the main thread sees).
_TIMEOUTS = (
    re.compile(r"gloo/transport/\S+\] Timed out waiting \d+ms"),
    re.compile(r"Application timeout caused pair closure"),
    re.compile(r"Watchdog caught collective operation timeout"),
)


def collective_timed_out(err: BaseException) -> bool:
    """Whether err is a collective's timeout (not any error that mentions a timeout: those are crashes)."""
    return isinstance(err, RuntimeError) and any(p.search(str(err)) for p in _TIMEOUTS)


def name_stalled(grace_s: float) -> tuple[int, str]:
    """After a collective timed out on this rank: (the live rank that should report, the message naming the
    ranks that did not report within grace_s and the last step each finished)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = identity.job_store()
        store.set_timeout(datetime.timedelta(seconds=10))
        store.set(f"{_PREFIX}/alive/{rank}", str(os.getpid()))
        deadline = time.monotonic() + grace_s
        while True:
            alive = [r for r in range(world) if store.check([f"{_PREFIX}/alive/{r}"])]
            if len(alive) == world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        stalled = [r for r in range(world) if r not in alive]
        last = {
            r: store.get(f"{_PREFIX}/step/{r}").decode() if store.check([f"{_PREFIX}/step/{r}"]) else "none"
            for r in range(world)
        }
    except Exception as err:  # noqa: BLE001 - the store is what failed; say so instead of a second traceback
        return rank, (
            f"a collective timed out and the job's store did not answer either ({str(err).splitlines()[0]}); "
            "under srun rank 0 serves it, so rank 0 is the likely one that hung or died"
        )
    if not stalled:
        return min(alive), (
            "a collective timed out but every rank reported in: none is stuck, a step was only "
            "slower than the timeout; raise dist.step_timeout_s"
        )
    named = ", ".join(identity.of(r).named(f"last finished step {last[r]}") for r in stalled)
    live_steps = sorted({last[r] for r in alive})
    return min(alive), (
        f"a collective timed out: {named} did not report within {grace_s:.0f} s, so it hung or "
        f"died; the {len(alive)} other rank(s) last finished step {'/'.join(live_steps)}"
    )
