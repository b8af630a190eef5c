"""Build this rank's share of the model, and nothing more: meta build, cut, shard, then materialise.

  1. GPT(cfg, tp, seed, device="meta")       every module, no memory, no random draws
  2. keep_chunks(rank_chunks(...))            drop what other pipeline ranks hold (names stay global)
  3. parallelize(...), cp_parallelize(...)    swap in TP layers, split sequences over cp, still on meta
  4. materialize(...)                         per parameter: the full tensor (keyed init, or a full state dict),
                                              this rank's slice of it, cast, placed; ZeRO-3 partitions it at once
  5. tie_across_stages(...)                   a pipeline's two copies of a tied embedding (model/tied.py)

The result is bitwise the model that the old route made (build everything, keep_chunks, parallelize) with the
same keyed init, at a peak of this rank's share plus one full tensor (tests/unit/test_model_build.py,
tests/distributed/test_model_build.py; bench/results/build_memory_cpu.md measures it).

Left out on purpose: reading a weights-only checkpoint lazily per tensor (it is read whole, memory-mapped, see
checkpoint/weights.py: load_model_state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from megatron_lite.config import Config
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.model.parallelize_cp import cp_parallelize
from megatron_lite.model.tied import tie_across_stages
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.pipeline.partition import rank_chunks
from megatron_lite.pipeline.schedules import resolve_schedule, v_shaped


def build_model(
    cfg: Config,
    ctx: ParallelContext,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    partition: Callable[[nn.Parameter], None] | None = None,
) -> GPT:
    """This rank's chunks and TP shards, initialised from (cfg.seed, parameter name), or from `weights` (a full
    state dict of the serial model). dtype and `partition` (see zero3_partitioner) serve a ZeRO-3 build; the
    default keeps fp32 parameters on ctx.device for the engine to take over."""
    p = cfg.parallel
    model = GPT(cfg.model, tp=ctx.tp_size, seed=cfg.seed, device="meta")
    v_shape = v_shaped(resolve_schedule(p.schedule, p.vpp))
    model.keep_chunks(rank_chunks(ctx.pp_rank, ctx.pp_size, p.vpp, cfg.model.n_layers, p.pp_layers, v_shape))
    model = parallelize(model, ctx.tp_group, p.sp)
    model = cp_parallelize(model, ctx.cp_group, p.cp_mode)
    model.materialize(ctx.device, dtype=dtype, weights=weights, partition=partition)
    return tie_across_stages(model, ctx.embed_group, ctx.pp_rank, ctx.pp_size)


def zero3_partitioner(ds_config: dict, ctx: ParallelContext) -> tuple[Callable[[nn.Parameter], None], torch.dtype]:
    """(partition, dtype) for build_model under ZeRO-3: each parameter is split over dp x cp as soon as it
    exists, exactly as DeepSpeed would split the built model in deepspeed.initialize (same deepspeed.zero.Init
    arguments, same per-parameter call), and in the dtype the engine trains in (bf16 params are rounded from
    the fp32 init, as the engine's cast does). With NVMe parameter offload, repairs.honour_explicit_zero3_dtype()
    must run first (the Trainer does); Engine's param_groups reads a partitioned parameter's `ds_shape`."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # As deepspeed.initialize does; before it, Init would read its config with a world of one.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    # module= makes Init do what DeepSpeed's ZeRO-3 setup does with a built model (it also swaps in ZeRO-3's
    # memory-efficient linear); an empty module gives it no parameter yet: they come one by one below.
    init = deepspeed.zero.Init(
        module=nn.Module(),
        data_parallel_group=ctx.dp_cp_group,
        config_dict_or_path=ds_config,
        dtype=dtype,
        mpu=ctx.mpu(),
    )

    def partition(param: nn.Parameter) -> None:
        init._convert_to_zero_parameters([param])  # what Init(module=model) runs for each of its parameters

    return partition, dtype
