"""Parameter, gradient and optimizer-state bytes per rank, as DeepSpeed 0.19 lays them out under our config.

engine/ds_config.py fixes the choices that decide it: AdamW (torch's, or DeepSpeed's CPU Adam when offloaded),
reduce_bucket_size 5e7 elements, overlap_comm on CUDA for ZeRO >= 2, bf16 parameters only for ZeRO 1-3 with
fp32 gradient accumulation and fp32 communication. With N ranks sharing the parameters (dp x cp; under zero.shard_size one group's), P parameters
on the rank in two AdamW groups of n_g elements, b bytes per DeepSpeed parameter (2 bf16, 4 fp32):

  ZeRO-0    the model's fp32 parameters 4P, AdamW moments 8P, a 4-byte step counter per tensor; fp32 .grad 4P
            from the first backward of a step to its end (docs/precision.md "Mixed precision": bf16 runs under autocast)
  ZeRO-1/2  one flat buffer per group padded to A_g = ceil(n_g / 2N) * 2N elements (b A_g; the model's tensors
            are views of it) and this rank's partition S_g = A_g / N as an fp32 master copy 4 S_g (a clone even
            in fp32) with moments 8 S_g (stage_1_and_2.py: nccl_start_alignment_factor 2, single_partition_of_
            fp32_groups). ZeRO-1 reduces inside step(): its fp32 .grad 4P and one reduce bucket of 5e7 elements
            live from the step's first backward to the step. ZeRO-2 reduces every backward: the bucket (x2 with
            overlap_comm) lives during each backward; what it accumulates into stays to the step: in fp32 every
            parameter that overlaps the partition, whole; in bf16 a compact fp32 partition 4 S_g.
  ZeRO-1 bf16   DeepSpeed's BF16_Optimizer instead: bf16 flat 2 A_g, fp32 master 4 S_g, moments 8 S_g and a
            full-size fp32 gradient buffer 4 A_g kept for good (bf16_optimizer.py); bf16 .grad 2P within a step
  ZeRO-3    each parameter split on its own into ceil(n_p / N) per rank (b each), fp32 master, fp32 gradient
            partition and moments of those (16 per element), a 5e7-element fp32 reduce bucket allocated at start
            (200 MB whatever the model), and every parameter of at most 1e5 elements kept whole on every rank
            (stage3_param_persistence_threshold) in a buffer of ceil(n_p / N) * N. Within a step the gathered
            parameters stay (max_live_parameters and reuse distance 1e9 elements keep all of a small model).
            hpZ (zero.hpz) keeps a secondary shard of each parameter released after its forward until the step:
            none below those 1e9 elements.
  offload   optimizer=cpu moves master, moments and the master gradients to host memory, with device staging
            buffers of the largest parameter (b m); param=cpu moves ZeRO-3's partitions to the host.
ZeRO-3's backward reduce-scatters the ipg bucket's gradients in fp32 copies of at most max(5e7, the largest
parameter) elements (a group, padded to N, when smaller).
Transients of the step: ZeRO-0 flattens every gradient to all-reduce it (4P, only when N > 1; its fused AdamW and
foreach norm make none); ZeRO-1/2 flatten each group's partition of gradients (4 S_g) and take fp64 copies of the
largest parameter for the norm (8m); their AdamW's own temporaries (CPU: sqrt and div of the largest tensor,
8 S_g; CUDA foreach: 4 S_g of the group).
Every figure here was measured on CPU with a live-tensor tracker, exact to the byte for ZeRO 0-3, fp32 and bf16,
offload or not, at N = 1 and 2 (tests/distributed/test_plan_validation.py). On a GPU, pinned host buffers are
rounded up to a power of two by torch's host allocator (host bytes only).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megatron_lite.plan.params import Param

BUCKET = 50_000_000  # reduce_bucket_size (elements), engine/ds_config.py
PERSIST = 100_000  # ZeRO-3 stage3_param_persistence_threshold (elements), DeepSpeed's default
MAX_LIVE = 1_000_000_000  # ZeRO-3 stage3_max_live_parameters (elements), DeepSpeed's default
FALLBACK_BUCKET = 500_000_000  # engine.allreduce_gradients' bucket (elements), ZeRO-0's flatten


@dataclass(frozen=True)
class States:
    """One rank's bytes, by what holds them. Device bytes unless named host."""

    params: int  # DeepSpeed's parameters: flat buffers, ZeRO-3 partitions and whole persistent ones
    grads: int  # gradient buffers kept from step to step (BF16_Optimizer's fp32 flat, ZeRO-3's partitions)
    optimizer: int  # fp32 master copy, AdamW moments and step counters (on the device)
    buffers: int  # ZeRO-3's reduce bucket, offload staging buffers, scalars DeepSpeed keeps
    host: int  # offloaded master, moments, gradients and ZeRO-3 parameters
    step_grads: int  # gradients a chunk's backward leaves allocated until the optimizer step
    backward: int  # allocated during each backward only (ZeRO-2's buckets, ZeRO-3's reduce buffers)
    step: int  # the optimizer step's own temporaries, on top of everything held then
    reduce: int = 0  # ZeRO-2's reduction copies at the end of each backward (next to `backward`)
    bucket_held: int = 0  # ZeRO-1's reduce bucket: from the step's first parameter gradient to the step
    step_held: int = 0  # ZeRO-3's gathered parameters: from the step's first forward to its last backward
    host_optimizer: int = 0  # of `host`: the offloaded master weights and moments
    host_params: int = 0  # of `host`: ZeRO-3's offloaded parameter partitions

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


def _aligned(n: int, N: int) -> int:
    return math.ceil(n / (2 * N)) * 2 * N


def _overlapping(params: list[Param], groups: list[list[Param]], N: int) -> int:
    """ZeRO-2 fp32: elements of every parameter overlapping the largest rank's partition, whole, per the flat
    layout of each group (stage_1_and_2.py: grads_in_partition is built from the overlapping parameters)."""
    worst = 0
    for rank in range(N):
        total = 0
        for group in groups:
            part = _aligned(sum(p.numel for p in group), N) // N
            lo, hi, start = rank * part, (rank + 1) * part, 0
            for p in group:
                if start < hi and start + p.numel > lo:
                    total += p.numel
                start += p.numel
        worst = max(worst, total)
    return worst


@functools.lru_cache(maxsize=65536)
def zero_states(
    params: tuple[Param, ...],
    N: int,
    stage: int,
    bf16: bool,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    cuda: bool = True,
    hpz: int = 1,
) -> States:
    """States of one rank holding `params` (plan/params.py) with N ranks sharing them (one ZeRO group: under
    zero.shard_size a replica's); hpz: ZeRO++ hpZ's secondary-shard group size."""
    groups = [[p for p in params if p.decay], [p for p in params if not p.decay]]
    n = [sum(p.numel for p in g) for g in groups]
    P, m, count = sum(n), max((p.numel for p in params), default=0), len(params)
    steps = 4 * sum(1 for g in n if g)  # a 0-d fp32 step per non-empty group (torch AdamW)
    if stage == 0:  # the step: the flatten when there is a DP/cp average to take (torch's fused AdamW and the
        #             foreach norm allocate nothing of the parameters' size)
        return States(
            params=4 * P,
            grads=0,
            optimizer=8 * P + 4 * count,
            buffers=0,
            host=0,
            step_grads=4 * P,
            backward=0,
            step=4 * min(P, FALLBACK_BUCKET) if N > 1 else 0,
        )
    b = 2 if bf16 else 4
    if stage in (1, 2):
        A = [_aligned(x, N) if x else 0 for x in n]
        S = [a // N for a in A]
        norm = 4  # _global_grad_norm
        if offload_optimizer:
            host = 16 * sum(S) + b * sum(S) + b * m  # master, master.grad, moments; bit16 staging; cpu temp buffer
            if stage == 2 and not bf16:  # accumulated_grads_in_cpu: every overlapping parameter, whole, kept
                host += b * _overlapping(params, groups, N)
            if stage == 1:  # the bucket (fp32) and the gradients (fp32 .grad, or bf16's fp32 grad_accum)
                return States(
                    params=b * sum(A),
                    grads=0,
                    optimizer=0,
                    buffers=b * m + norm,
                    host=host,
                    step_grads=4 * P,
                    backward=0,
                    step=8 * m,
                    bucket_held=4 * BUCKET,
                    host_optimizer=12 * sum(S),
                )
            return States(
                params=b * sum(A),
                grads=0,
                optimizer=0,
                buffers=b * m + norm,
                host=host,
                step_grads=0,
                backward=_bucket(stage, b, cuda, P),
                step=8 * m,
                host_optimizer=12 * sum(S),
                reduce=_reduce_copies(b, P),
            )
        optimizer = 4 * sum(S) + 8 * sum(S) + steps
        flat_partition = 4 * max(S)
        adam = _adam_temp(S, S, cuda)
        if stage == 1 and bf16:  # BF16_Optimizer
            return States(
                params=2 * sum(A),
                grads=4 * sum(A),
                optimizer=optimizer,
                buffers=norm,
                host=0,
                step_grads=2 * P,
                backward=0,
                step=max(4 * sum(A), adam),
            )
        if stage == 1:
            return States(
                params=b * sum(A),
                grads=0,
                optimizer=optimizer,
                buffers=norm,
                host=0,
                step_grads=4 * P,
                backward=0,
                step=max(flat_partition + 8 * m, adam),
                bucket_held=4 * BUCKET,
            )
        held = 4 * sum(S) if bf16 else 4 * _overlapping(params, groups, N)
        return States(
            params=b * sum(A),
            grads=0,
            optimizer=optimizer,
            buffers=norm,
            host=0,
            step_grads=held,
            backward=_bucket(2, b, cuda, P),
            step=max((0 if bf16 else flat_partition) + 8 * m, adam),
            reduce=_reduce_copies(b, P),
        )
    # ZeRO-3
    shards = [sum(math.ceil(p.numel / N) for p in g) for g in groups]
    whole = sum(math.ceil(p.numel / N) * N for p in params if p.numel <= PERSIST) if N > 1 else 0
    # Gathered for compute: at N = 1 the partitions are the whole parameters, unless offloaded to a host the GPU
    # must copy them from (on a CPU, host and device are one memory: nothing is copied)
    fetched = N > 1 or (offload_param and cuda)
    gathered = min(sum(p.numel for p in params if p.numel > PERSIST or N == 1), MAX_LIVE) if fetched else 0
    partitions = b * sum(shards)
    # hpZ: a parameter released after its forward keeps a secondary shard, 1/hpz of it, until the step. DeepSpeed
    # releases only past max_live_parameters (the reuse distance, also 1e9, keeps the rest until their backward),
    # so a model with fewer gathered elements keeps none (measured on CPU at d_model 256: not a byte)
    releasable = sum(p.numel for p in params if p.numel > PERSIST) - MAX_LIVE
    secondary = b * math.ceil(releasable / hpz) if hpz > 1 and N > 1 and releasable > 0 else 0
    scalars = 1 + 8  # nan tracker, fp64 norm
    if offload_optimizer:
        host = 16 * sum(shards) + 4 * sum(shards)
        optimizer, grads, scalars = 0, 0, 1 + 4
    else:
        host, optimizer, grads = 0, 4 * sum(shards) + 8 * sum(shards) + steps, 4 * sum(shards)
    host_params = partitions if offload_param else 0
    return States(
        params=partitions - host_params + b * whole,
        grads=grads,
        optimizer=optimizer,
        buffers=4 * BUCKET + scalars,
        host=host + host_params,
        step_grads=0,
        step_held=b * gathered + secondary,
        backward=_zero3_reduce(shards, N, m),
        step=max(4 * max(shards), _adam_temp(shards, shards, cuda)),
        host_optimizer=12 * sum(shards) if offload_optimizer else 0,
        host_params=host_params,
    )


def _zero3_reduce(shards: list[int], N: int, m: int) -> int:
    """ZeRO-3's reduce-scatter copies (fp32) of what one reduction takes: the gradients of the parameters in the
    ipg bucket, which is flushed before it would pass reduce_bucket_size (a larger parameter goes alone), so at
    most max(BUCKET, the largest parameter) elements, and at most a group (padded to N) for a small model.
    Pricing the whole group instead puts llama-7b 25 GiB too high (tests/distributed/test_plan_validation.py
    measures a model larger than one bucket)."""
    return 4 * min(N * max(shards), max(BUCKET, math.ceil(m / N) * N))


def _bucket(stage: int, b: int, cuda: bool, P: int) -> int:
    """ZeRO-2's reduce bucket, x2 with overlap_comm on CUDA."""
    return (2 if cuda else 1) * BUCKET * b


def _reduce_copies(b: int, P: int) -> int:
    """ZeRO-2's reduction at the end of a backward flattens what the bucket holds (and casts it to fp32 when
    bf16): by then the activations are gone, so this is a phase of its own."""
    return min(P, BUCKET) * (b + (4 if b == 2 else 0))


def _adam_temp(tensors: list[int], groups: list[int], cuda: bool) -> int:
    """torch AdamW's temporaries: CUDA's foreach kernel takes the sqrt of a whole group at once (4 bytes per
    element), the CPU's single-tensor kernel sqrt and div of one tensor at a time (8 per element)."""
    return 4 * max(groups, default=0) if cuda else 8 * max(tensors, default=0)
