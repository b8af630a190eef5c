"""Stop requests: SIGUSR1 (Slurm's warning before preemption or the time limit, `sbatch --signal`) and
SIGTERM (what torchrun forwards to its workers when it is told to stop, and what Slurm sends at the end).

The handlers only set a flag, so a signal never interrupts a collective or a checkpoint write half-way. The
ranks agree on the flag at every step boundary (a max all-reduce): then they save a checkpoint and return;
before the first step (a signal during start-up) they return without saving, as nothing has trained. A second
signal while the checkpoint is written finds the flag already set and changes nothing.

`install()` runs first thing in train.py, before torch and DeepSpeed are imported (several seconds), so a
signal at start-up is caught too; this module imports nothing heavy for that reason.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_raised: list[int] = []


def _handle(signum, frame) -> None:
    _raised.append(signum)


def install() -> None:
    """Route SIGUSR1 and SIGTERM to the flag (idempotent)."""
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def ignore() -> None:
    """Ignore SIGUSR1 and SIGTERM from now on: for the end of the process, once the run has returned. While the
    interpreter shuts down, Python puts the default action back in place of its handlers, so a stop signal then
    (Slurm's, torchrun's, a scheduler's) killed a finished run with exit code 143, which torchrun and Slurm take
    for a crash. An ignored signal survives the shutdown."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def requested() -> bool:
    """Whether this process has received a stop signal."""
    return bool(_raised)


def agreed(device) -> bool:
    """Collective over the default group: whether any rank has received a stop signal."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if _raised else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
