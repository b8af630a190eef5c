"""ParallelContext: the rank grid and every process group, built once and passed explicitly.

Grid order follows Megatron: tp varies fastest, then cp, then dp, then pp, so
`rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank` and a TP group (the chattiest) sits inside a
node, with the context-parallel ring next to it.

Context parallelism splits each sequence over the cp ranks of one replica: parameters are replicated over cp,
so gradients are reduced (and ZeRO partitions its state) over dp x cp (`dp_cp_group`), while samples are split
over dp only. The context offers the `mpu` interface that DeepSpeed expects, with its sequence-parallel hooks
for exactly this case: DeepSpeed then partitions and reduces over dp x cp, and it sums gradients over cp
while it averages them over dp (its Ulysses convention), which is why each cp rank's loss is its share of
the sequence's mean, not a mean of its own (model/gpt.py, LMHead). Gradient clipping reduces norms over the
model-parallel group (tp x pp).

Left out on purpose: the expert parallel axis.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(root: str, **extra: str) -> dict[str, str]:
    """The environment of a torchrun world that the tests and tools start from the checkout at `root`: one
    OpenMP thread per rank, wandb off, and `root` first on PYTHONPATH, ahead of what is there (an offline GPU
    node's packages installed with `pip --target` are found through it), then `extra`."""
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path, **extra}


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
        # connectFullMesh failed with "Connection refused" (or hung). Each worker group gets its own key space.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

        def client() -> dist.TCPStore:
            return dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
            )

        store = client()
        prefix, formed = _group_prefix(store, client, rank)
        try:
            dist.init_process_group(
                backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
            )
            dist.barrier()  # every rank holds its token now (NCCL's init may return before the others join)
        finally:
            if formed is not None:
                formed.set()
    else:
        dist.init_process_group(backend, timeout=timeout)


_HELLO, _TOKEN = "megatron_lite/hello", "megatron_lite/token/"


def _group_prefix(store, client, rank: int):
    """A key-space prefix that every rank of this worker group shares and no earlier group used, agreed over the
    store torchrun's agents keep for the whole job. Not TORCHELASTIC_RESTART_COUNT: each agent counts its own
    restarts, and under a multi-node rendezvous an agent restarted for a membership change (its workers alive
    when a failed node's agent re-joined) keeps its count while the failed node's raises it, so one group's
    ranks would use two prefixes and hang in init until dist.timeout_s, at every later try too (--nnodes 1:2,
    one rank per agent, the second agent's rank SIGKILLed). Instead each rank but 0 queues a fresh
    nonce and waits for the token filed under it; rank 0 makes a fresh token and, from a thread with its own
    connection until its group is formed, files it under every nonce it pops (a dead group's nonces are answered
    too, harmlessly: nobody waits for them). Returns (prefix, the event that ends rank 0's thread, or None)."""
    import threading
    import uuid

    if rank != 0:
        nonce = uuid.uuid4().hex
        store.queue_push(_HELLO, nonce)
        return store.get(_TOKEN + nonce).decode(), None  # waits up to the store's timeout
    token = f"megatron_lite/group_{uuid.uuid4().hex}"
    formed = threading.Event()

    def answer() -> None:
        own = client()
        while not formed.is_set():
            try:
                nonce = own.queue_pop(_HELLO, block=False).decode()
            except dist.QueueEmptyError:
                formed.wait(0.02)
                continue
            own.set(_TOKEN + nonce, token)

    threading.Thread(target=answer, name="megatron_lite-group-prefix", daemon=True).start()
    return token, formed


def set_collective_timeout(seconds: int) -> None:
    """Make every process group created so far (ours, DeepSpeed's, the default) time out its collectives
    after `seconds`. torch offers this only as distributed_c10d._set_pg_timeout (gloo and NCCL); it is the
    call that lets the trainer use a long timeout for start-up and checkpoints and a short one in between."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> torch.Tensor:
    """Global ranks laid out as a (pp, dp, cp, tp) tensor."""
    assert world_size % (tp * cp * pp) == 0, (world_size, tp, cp, pp)
    return torch.arange(world_size).view(pp, world_size // (tp * cp * pp), cp, tp)


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
    cp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    cp_group: object  # None when cp = 1
    dp_cp_group: object  # dp x cp: the ranks holding the same parameters (gradient reduction, ZeRO partitions)
    mp_group: object  # tp x pp: the ranks that together hold one model replica
    hpz_group: object  # hpz consecutive ranks of dp_cp_group: ZeRO++ hpZ's secondary shards (None: hpz = 1)
    # Hybrid sharding (zero.shard_size): ZeRO partitions over shard_size consecutive dp ranks (x cp), and the dp
    # ranks hold dp / shard_size replicas of those partitions. Without it: one group of all dp ranks.
    shard_size: int  # dp ranks per ZeRO partition group
    zero_group: object  # ZeRO's partition group: shard_size dp ranks x cp (dp_cp_group without hybrid sharding)
    zero_dp_group: object  # zero_group's ranks at this cp rank: what DeepSpeed's mpu calls the data-parallel group
    replica_group: object  # the ranks at this place of every replica's zero_group (None: one replica)
    embed_group: object  # first and last pipeline rank of this (dp, cp, tp) position: the two tied-embedding copies
    device: torch.device

    @classmethod
    def build(
        cls, tp: int = 1, pp: int = 1, cp: int = 1, hpz: int = 1, shard_size: int | None = None
    ) -> ParallelContext:
        """Build groups on the already-initialised default process group; hpz: zero.hpz (ZeRO++ hpZ's groups);
        shard_size: zero.shard_size (hybrid sharding's groups)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = rank_grid(world, tp, pp, cp)  # (pp, dp, cp, tp)
        pp_rank, dp_rank, cp_rank, tp_rank = (int(i) for i in (grid == rank).nonzero()[0])
        dp = grid.shape[1]

        def lines(axes: str) -> list[list[int]]:
            """Every group along `axes` (letters of "pdct"): the ranks that differ only in those coordinates."""
            order = "pdct"
            moved = grid.permute(*[order.index(a) for a in order if a not in axes], *[order.index(a) for a in axes])
            return moved.reshape(-1, math.prod(grid.shape[order.index(a)] for a in axes)).tolist()

        embed_groups = [[line[0], line[-1]] for line in lines("p")] if pp > 1 else []
        hpz_groups = [line[i : i + hpz] for line in lines("dc") for i in range(0, len(line), hpz)] if hpz > 1 else []
        dp_group = _my_group(rank, lines("d"))
        cp_group = _my_group(rank, lines("c")) if cp > 1 else None  # no world-size set of one-rank groups
        dp_cp_group = _my_group(rank, lines("dc")) if cp > 1 else dp_group
        shard = shard_size or dp
        if shard < dp:  # a "dc" line runs cp fastest: shard consecutive dp ranks with their cp ranks are shard*cp
            zero_group = _my_group(
                rank, [line[i : i + shard * cp] for line in lines("dc") for i in range(0, dp * cp, shard * cp)]
            )
            zero_dp_group = _my_group(rank, [line[i : i + shard] for line in lines("d") for i in range(0, dp, shard)])
            replica_group = _my_group(rank, [line[i::shard] for line in lines("d") for i in range(shard)])
        else:
            zero_group, zero_dp_group, replica_group = dp_cp_group, dp_group, None
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return cls(
            world_size=world,
            rank=rank,
            local_rank=local_rank,
            tp_size=tp,
            pp_size=pp,
            dp_size=dp,
            cp_size=cp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            cp_rank=cp_rank,
            tp_group=_my_group(rank, lines("t")),
            dp_group=dp_group,
            cp_group=cp_group,
            dp_cp_group=dp_cp_group,
            pp_group=_my_group(rank, lines("p")),
            mp_group=_my_group(rank, lines("pt")),
            embed_group=_my_group(rank, embed_groups),
            hpz_group=_my_group(rank, hpz_groups),
            shard_size=shard,
            zero_group=zero_group,
            zero_dp_group=zero_dp_group,
            replica_group=replica_group,
            device=device,
        )

    def destroy(self) -> None:
        """Shut down this context's groups (the default group stays). A gloo group keeps threads that wake
        hundreds of times a second until it is shut down: a process that trains run after run (the test worlds,
        tools that measure several layouts) would otherwise gather them run by run."""
        mine = {
            id(g): g
            for g in (
                self.tp_group,
                self.pp_group,
                self.dp_group,
                self.cp_group,
                self.dp_cp_group,
                self.mp_group,
                self.embed_group,
                self.hpz_group,
                self.zero_group,
                self.zero_dp_group,
                self.replica_group,
            )
            if g is not None
        }
        for group in mine.values():
            dist.destroy_process_group(group)

    def pp_global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` at this rank's (dp, cp, tp) position."""
        return ((pp_rank * self.dp_size + self.dp_rank) * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @property
    def replicas(self) -> int:
        """Copies of the ZeRO states over the dp ranks (hybrid sharding); 1 without it."""
        return self.dp_size // self.shard_size

    @property
    def shard_rank(self) -> int:
        """This rank's place among the dp ranks of its ZeRO group (dp_rank without hybrid sharding)."""
        return self.dp_rank % self.shard_size

    @property
    def replica_rank(self) -> int:
        """Which replica of the ZeRO states this rank holds part of (0 without hybrid sharding)."""
        return self.dp_rank // self.shard_size

    @property
    def is_rank0(self) -> bool:
        """Global rank 0: the rank that logs and commits checkpoints (the first rank of no group in particular)."""
        return self.rank == 0

    def mpu(self) -> DeepSpeedMPU:
        return DeepSpeedMPU(self)


class DeepSpeedMPU:
    """The model-parallel-unit interface DeepSpeed calls (names are DeepSpeed's, not ours)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    # With hybrid sharding DeepSpeed sees one replica: its data-parallel ranks are one ZeRO group's (the engine
    # averages over the replicas, engine/repairs/hybrid.py).
    def get_data_parallel_group(self):
        return self.ctx.zero_dp_group

    def get_data_parallel_rank(self) -> int:
        return self.ctx.shard_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.shard_size

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

    # Context parallelism is what DeepSpeed calls sequence parallelism (Ulysses): with these hooks it partitions
    # ZeRO state and reduces gradients over dp x cp, summing over cp and averaging over dp.
    def get_sequence_parallel_group(self):
        return self.ctx.cp_group

    def get_sequence_parallel_rank(self) -> int:
        return self.ctx.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.ctx.cp_size

    def get_sequence_data_parallel_group(self):
        return self.ctx.zero_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.ctx.shard_rank * self.ctx.cp_size + self.ctx.cp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.ctx.shard_size * self.ctx.cp_size

    def get_pipeline_model_parallel_group(self):
        return self.ctx.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ctx.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ctx.pp_size

    # No get_slice_parallel_*: DeepSpeed reads it as the TP size where it cuts weights (its universal loader,
    # which we no longer use, cut tp x pp ways with a TP rank and asserted); in its own pipeline it means tp x pp.
