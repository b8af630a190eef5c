"""Hybrid sharding (zero.shard_size) on DeepSpeed 0.19's ZeRO, which has none of its own since MiCS was removed.

DeepSpeed is handed one ZeRO group as its whole data-parallel world (parallel/context.py's mpu): it partitions,
reduces and gathers within the group, knowing nothing of the other groups, the replicas. Two things remain, both
here because they touch DeepSpeed's private state:

- the gradients: after DeepSpeed's reduction within the group and before its step measures and clips them, each
  rank's reduced partition is averaged with the same partition of every other replica (one all-reduce over the
  replica group a step, of 1/shard of the gradients at stages 2-3);
- the checkpoint: every replica would write the same files (DeepSpeed names them by the rank within the group),
  so only the first replica writes; a load reads them in every replica.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def average_over_replicas(optimizer, group, replicas: int) -> None:
    """Make the ZeRO optimizer first average this rank's reduced gradients over the replicas (`group`: the rank at
    this place of every replica's ZeRO group), once a step. Where they are, by DeepSpeed optimizer:

      ZeRO-3                         the flat buffer of this rank's partitions (every parameter's), filled by the
                                     reduce-scatter of each backward, averaged at the accumulation boundary
      ZeRO-1 and -2                  averaged_gradients: this rank's partition of each group, as tensors the
                                     boundary assembled
      ZeRO-1 bf16 (BF16_Optimizer)   the whole fp32 gradients, all-reduced within the group: it measures the norm
                                     on them whole, so all of them are averaged

    Without it each replica steps on its own group's batch only (tests/distributed/test_hybrid_sharding.py follows
    the single process; measured without, at dp 4 in groups of 2: losses 0.13 off by step 6, gradient norms 1.38x;
    ZeRO-3 with CPU offload averaged at the step instead of the boundary, the same)."""
    # ZeRO-3 before its boundary's own work, where an offloaded optimizer copies the partitions to the host and
    # measures them; the others before the step (their offload measures each gradient as it copies it in backward)
    name = "finalize_gradient_accumulation_boundary" if hasattr(optimizer, "grad_partitions_flat_buffer") else "step"
    then = getattr(optimizer, name)

    def after_average(*args, **kwargs):
        for flat, scatter in _reduced_gradients(optimizer):
            dist.all_reduce(flat, group=group)
            flat.div_(replicas)
            scatter(flat)
            del flat  # (one group's copy at a time: plan/states.py prices the step's transients)
        return then(*args, **kwargs)

    setattr(optimizer, name, after_average)


def _reduced_gradients(optimizer):
    """(flat tensor, put it back) for each of this rank's reduced gradient buffers at the step."""
    if hasattr(optimizer, "grad_partitions_flat_buffer"):  # ZeRO-3
        yield optimizer.grad_partitions_flat_buffer, _in_place
    elif hasattr(optimizer, "fp32_groups_gradients_flat"):  # BF16_Optimizer
        for flat in optimizer.fp32_groups_gradients_flat:
            yield flat, _in_place
    else:  # ZeRO-1/2
        for grads in optimizer.averaged_gradients.values():
            if grads is None:
                continue
            flat = getattr(grads, "flat_partition", None)
            if flat is not None:
                yield flat.view(-1), _in_place
                continue

            def scatter(reduced, grads=grads):
                offset = 0
                for g in grads:
                    g.copy_(reduced[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

            yield torch.cat([g.reshape(-1) for g in grads]), scatter


def _in_place(_flat) -> None:
    pass


def write_once_per_replica(ds_engine, replica_rank: int) -> None:
    """Only the first replica writes DeepSpeed's checkpoint files: the others hold the same states under the same
    file names (its model and ZeRO files are named by the rank within the ZeRO group). DeepSpeed decides who
    writes once, when the engine is built (its _configure_checkpointing), in these two flags."""
    if replica_rank > 0:
        ds_engine.save_non_zero_checkpoint = False
        ds_engine.save_zero_checkpoint = False
