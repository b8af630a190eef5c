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
from megatron_lite.layout import Layout
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.model.parallelize_cp import cp_parallelize
from megatron_lite.model.tied import tie_across_stages
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.pipeline.partition import rank_chunks


def build_model(
    cfg: Config,
    ctx: ParallelContext,
    layout: Layout,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    partition: Callable[[nn.Parameter], None] | None = None,
) -> GPT:
    """This rank's chunks and TP shards, initialised from (cfg.seed, parameter name), or from `weights` (a full
    state dict of the serial model), for the run's `layout` (its virtual stages, in loops or a V). dtype and
    `partition` (engine/zero_init.zero3_partitioner) serve a ZeRO-3 build; the default keeps fp32 parameters on
    ctx.device for the engine to take over."""
    p = cfg.parallel
    model = GPT(cfg.model, tp=ctx.tp_size, seed=cfg.seed, device="meta")
    chunks = rank_chunks(ctx.pp_rank, ctx.pp_size, layout.vpp, cfg.model.n_layers, p.pp_layers, layout.v_shape)
    model.keep_chunks(chunks)
    model = parallelize(model, ctx.tp_group, p.sp)
    model = cp_parallelize(model, ctx.cp_group, p.cp_mode)
    model.materialize(ctx.device, dtype=dtype, weights=weights, partition=partition)
    return tie_across_stages(model, ctx.embed_group, ctx.pp_rank, ctx.pp_size)
