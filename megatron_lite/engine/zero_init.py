"""ZeRO-3's partitioning at build time: every parameter split over dp x cp the moment it exists, never whole on a
rank (model/build.py calls `partition` per parameter as it materialises them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from megatron_lite.engine.repairs import honour_explicit_zero3_dtype, use_hpz_group
from megatron_lite.parallel.context import ParallelContext


def zero3_partitioner(ds_config: dict, ctx: ParallelContext) -> tuple[Callable[[nn.Parameter], None], torch.dtype]:
    """(partition, dtype) for build_model under ZeRO-3: each parameter is split over the ZeRO group (dp x cp, or
    zero.shard_size's group) as soon as it exists, exactly as DeepSpeed would split the built model in
    deepspeed.initialize (same deepspeed.zero.Init arguments, same per-parameter call), and in the dtype the engine
    trains in (bf16 params are rounded from the fp32 init, as the engine's cast does); with NVMe parameter offload,
    after repairs.honour_explicit_zero3_dtype. Engine's param_groups reads a partitioned parameter's `ds_shape`."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if ds_config["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
        honour_explicit_zero3_dtype()
    # As deepspeed.initialize does; before it, Init would read its config with a world of one.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    if ctx.hpz_group is not None:
        use_hpz_group(ctx.hpz_group)
    # module= makes Init do what DeepSpeed's ZeRO-3 setup does with a built model (it also swaps in ZeRO-3's
    # memory-efficient linear); an empty module gives it no parameter yet: they come one by one below.
    init = deepspeed.zero.Init(
        module=nn.Module(),
        data_parallel_group=ctx.zero_group,
        config_dict_or_path=ds_config,
        dtype=dtype,
        mpu=ctx.mpu(),
        zero_param_parallel_group=ctx.hpz_group,
    )

    def partition(param: nn.Parameter) -> None:
        init._convert_to_zero_parameters([param])  # what Init(module=model) runs for each of its parameters

    return partition, dtype
