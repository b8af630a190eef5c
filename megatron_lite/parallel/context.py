"""ParallelContext: the rank grid and every process group, built once and passed explicitly.

Grid order follows Megatron: tp varies fastest, then dp, then pp, so `rank = (pp_rank * dp + dp_rank) * tp +
tp_rank` and a TP group (the chattiest) sits inside a node. The context also offers the `mpu` interface that
DeepSpeed expects, so ZeRO partitions over the DP group only and gradient clipping reduces norms over the
model-parallel group.

Left out on purpose: context and expert parallel axes (no groups until the features exist).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = 600) -> None:
    """Start the default process group from torchrun/Slurm env vars, or as a one-rank group for `python train.py`."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun serves one store for the whole job, across restarts, and torch 2.13 does not prefix it per
        # attempt: a restarted worker group found the dead group's addresses under the same keys, and gloo's
        # connectFullMesh failed with "Connection refused" (or hung). Each attempt gets its own key space.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"megatron_lite/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def set_collective_timeout(seconds: int) -> None:
    """Make every process group created so far (ours, DeepSpeed's, the default) time out its collectives
    after `seconds`. torch offers this only as distributed_c10d._set_pg_timeout (gloo and NCCL); it is the
    call that lets the trainer use a long timeout for start-up and checkpoints and a short one in between."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def rank_grid(world_size: int, tp: int, pp: int) -> torch.Tensor:
    """Global ranks laid out as a (pp, dp, tp) tensor."""
    assert world_size % (tp * pp) == 0, (world_size, tp, pp)
    return torch.arange(world_size).view(pp, world_size // (tp * pp), tp)


def _my_group(rank: int, groups_ranks: list[list[int]]):
    """Create every group (all ranks must call new_group for each, in order) and return the one holding rank."""
    mine = None
    for ranks in groups_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class ParallelContext:
    world_size: int
    rank: int
    local_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object  # tp x pp: the ranks that together hold one model replica
    embed_group: object  # first and last pipeline rank of this (dp, tp) position: the two tied-embedding copies
    device: torch.device

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1) -> "ParallelContext":
        """Build groups on the already-initialised default process group."""
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = rank_grid(world, tp, pp)
        pp_rank, dp_rank, tp_rank = (int(i) for i in (grid == rank).nonzero()[0])
        dp = grid.shape[1]
        tp_groups = [grid[p, d, :].tolist() for p in range(pp) for d in range(dp)]
        dp_groups = [grid[p, :, t].tolist() for p in range(pp) for t in range(tp)]
        pp_groups = [grid[:, d, t].tolist() for d in range(dp) for t in range(tp)]
        mp_groups = [grid[:, d, :].flatten().tolist() for d in range(dp)]
        embed_groups = [[grid[0, d, t].item(), grid[-1, d, t].item()] for d in range(dp) for t in range(tp)] \
            if pp > 1 else []
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return cls(
            world_size=world, rank=rank, local_rank=local_rank, tp_size=tp, pp_size=pp, dp_size=dp,
            tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
            tp_group=_my_group(rank, tp_groups), dp_group=_my_group(rank, dp_groups),
            pp_group=_my_group(rank, pp_groups), mp_group=_my_group(rank, mp_groups),
            embed_group=_my_group(rank, embed_groups), device=device,
        )

    def pp_global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` at this rank's (dp, tp) position."""
        return (pp_rank * self.dp_size + self.dp_rank) * self.tp_size + self.tp_rank

    @property
    def is_first(self) -> bool:
        """Global rank 0: the rank that logs and commits checkpoints."""
        return self.rank == 0

    def mpu(self) -> "DeepSpeedMPU":
        return DeepSpeedMPU(self)


class DeepSpeedMPU:
    """The model-parallel-unit interface DeepSpeed calls (names are DeepSpeed's, not ours)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def get_data_parallel_group(self):
        return self.ctx.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_size

    def get_model_parallel_group(self):
        return self.ctx.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.ctx.pp_rank * self.ctx.tp_size + self.ctx.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size * self.ctx.pp_size

    def get_tensor_model_parallel_group(self):
        return self.ctx.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size

    def get_pipeline_model_parallel_group(self):
        return self.ctx.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ctx.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ctx.pp_size

    # DeepSpeed's checkpoint code names files by this "slice" rank.
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
