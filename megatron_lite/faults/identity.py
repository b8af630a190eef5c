"""Who a rank is, as the fault reports name it: its global rank, its host and its local rank there.

Every rank publishes its identity once, at start-up, in the job's key-value store (torchrun's agent serves it;
under srun rank 0's process does), so that whoever names a rank later reads it back without a collective: the
hang report (faults/stalls.py), when collectives are what failed, and the straggler report
(faults/stragglers.py).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

_PREFIX = "megatron_lite/identity"


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    host: str | None = None  # None: not published, or the store no longer answers
    local_rank: int | None = None

    def __str__(self) -> str:
        return self.named()

    def named(self, note: str = "") -> str:
        """e.g. `rank 3 (host node07, local rank 3; last finished step 12)` with note "last finished step 12"."""
        where = f"host {self.host}, local rank {self.local_rank}" if self.host is not None else "host unknown"
        return f"rank {self.rank} ({where}{'; ' + note if note else ''})"

    def to_json(self) -> dict:
        return {"rank": self.rank, "host": self.host, "local_rank": self.local_rank}


def own(rank: int) -> RankIdentity:
    """This process's identity as global rank `rank`: its host is Slurm's name for the node under Slurm (what
    ExcNodeList takes), else the host name."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return RankIdentity(rank, host, int(os.environ.get("LOCAL_RANK", 0)))


def job_store():
    """The job's key-value store (torchrun's agent's, or rank 0's under srun), which faults/stalls.py uses too."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def publish(rank: int) -> None:
    """Say in the job's store who global rank `rank` (this process) is."""
    me = own(rank)
    job_store().set(f"{_PREFIX}/{rank}", f"{me.local_rank} {me.host}")


def of(rank: int, timeout_s: float = 10.0) -> RankIdentity:
    """Rank `rank`'s identity as it published it; only the rank when it did not or the store does not answer."""
    try:
        store = job_store()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        if not store.check([f"{_PREFIX}/{rank}"]):
            return RankIdentity(rank)
        local_rank, host = store.get(f"{_PREFIX}/{rank}").decode().split(" ", 1)
        return RankIdentity(rank, host, int(local_rank))
    except Exception:  # noqa: BLE001 - a report names what it can
        return RankIdentity(rank)
