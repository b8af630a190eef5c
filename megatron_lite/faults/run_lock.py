"""One run per run.dir: global rank 0 holds an exclusive lock on ${run.dir}/.lock while the run lives.

Two runs started on one run.dir (a second sbatch of the same command, a typo'd resubmission) would each resume
the same checkpoint and take turns renaming the other's checkpoints aside as unsound; metrics.jsonl would get
every step twice. The lock is an flock(2): the kernel drops it when the holder exits however it ends (a crash, a
SIGKILL), so a restart (torchrun, Slurm's requeue) takes it again at once; on a shared file system it needs
lock support (NFSv4, Lustre and GPFS have it). The file holds the holder's host, pid and start time, for the
message the second run gets.

Only rank 0 tries the lock, and a refused rank 0 still joins the process group: every rank then ends with the
refusal (exit 3). Under Slurm rank 0 serves the rendezvous, so a rank 0 that left before it would leave the
others waiting to connect until Slurm killed them, and the script would requeue the killed job as a crash.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

import torch
import torch.distributed as dist

from megatron_lite.errors import RunError

LOCK = ".lock"


class RunDirLock:
    def __init__(self, run_dir: str):
        self.path, self.fd = os.path.join(run_dir, LOCK), None
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"run.dir={run_dir} is in use by another run ({holder}): two runs on one run.dir would "
                "resume the same checkpoint and rename each other's aside; wait for it to end, or use "
                "another run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        )
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def agree_on_refusal(refusal: RunError | None, run_dir: str, device: torch.device) -> None:
    """Collective over the default group (tensors on `device`, the run's): raise rank 0's refusal (or a pointer to
    it) on every rank."""
    refused = torch.tensor([refusal is not None], dtype=torch.int32, device=device)
    dist.broadcast(refused, src=0)
    if refusal is not None:
        raise refusal
    if refused.item():
        raise RunError(f"run.dir={run_dir} is in use by another run (rank 0 names it)")
