"""The layout planner: predicted memory per GPU and step time for a layout, and the search over layouts.

    predict(model, layout, cluster)      memory of every pipeline rank (plan/memory.py) and the step time
                                         (plan/timing.py), with tokens/s, TFLOP/s per GPU and MFU
    plan.search.search(...)              every valid layout for a model, batch and cluster, ranked
    plan.report                          the one-line `--check` summary, the `--plan` table, the JSON rows

Everything here is a pure function of the configuration: no process group, no tensor, no GPU. The validation
of its figures against measured memory (tests/distributed/test_plan_validation.py) and published throughput
(plan/published.py, tests/unit/test_plan_published.py) is in docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.config import ClusterConfig, ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.metrics.flops import step_flops
from megatron_lite.pipeline.schedules import v_shaped
from megatron_lite.plan.hardware import DGX_GPUS, Cluster, gpu_named
from megatron_lite.plan.memory import RankMemory, rank_memory
from megatron_lite.plan.params import rank_params
from megatron_lite.plan.timing import OURS, StepModel, StepTime, System

__all__ = ["Cluster", "Layout", "Prediction", "cluster_from_config", "predict", "predict_memory"]


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    ranks: list[RankMemory]  # the pipeline ranks priced (every rank that can hold the peak)
    usable_bytes: int
    step: StepTime
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (metrics/flops.py's count) per second per GPU
    mfu: float

    @property
    def memory_bytes(self) -> int:
        """Predicted peak bytes on the fullest GPU."""
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)


def cluster_from_config(c: ClusterConfig, world_size: int | None = None) -> Cluster:
    """The cluster of the `cluster` config group; nodes default to what world_size needs (else 1)."""
    gpu = gpu_named(c.gpu)
    nodes = c.nodes or (math.ceil(world_size / c.gpus_per_node) if world_size else 1)
    return Cluster(
        gpu=gpu,
        gpus_per_node=c.gpus_per_node,
        nodes=nodes,
        intra_node_GBps=c.intra_node_GBps or gpu.nvlink_GBps,
        inter_node_GBps=c.inter_node_GBps or gpu.node_net_GBps / DGX_GPUS * c.gpus_per_node,
        achievable=c.achievable,
        reserve_bytes=int(c.reserve_gib * 2**30),
    )


def priced_ranks(model: ModelConfig, layout: Layout) -> list[int]:
    """The pipeline ranks that can hold the peak: with an even split the first (embedding, most micro-batches in
    flight) and the last (head, loss); a middle rank holds what the first does minus the embedding. An uneven
    split (parallel.pp_layers) prices every rank."""
    if layout.pp_layers is not None:
        return list(range(layout.pp))
    return sorted({0, layout.pp - 1})


def predict_memory(model: ModelConfig, layout: Layout, cuda: bool = True) -> list[RankMemory]:
    """The memory of every pipeline rank that can hold the peak (cuda=False: the CPU's kernels, for validation)."""
    return [rank_memory(model, layout, r, cuda) for r in priced_ranks(model, layout)]


def predict(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    system: System = OURS,
    cuda: bool = True,
    ranks: list[RankMemory] | None = None,
) -> Prediction:
    """Memory and time of `layout` (in its precision) for `model` on `cluster`; `ranks`: predict_memory's
    result, if at hand."""
    ranks = ranks if ranks is not None else predict_memory(model, layout, cuda)
    pp_layers = list(layout.pp_layers) if layout.pp_layers else None
    params = [
        rank_params(model, layout.tp, layout.pp, layout.vpp, r, pp_layers, v_shaped(layout.schedule)).numel
        for r in priced_ranks(model, layout)
    ]
    step = StepModel(model, layout, cluster, system).step(params)
    tokens = layout.global_batch_size * model.seq_len
    flops, _ = step_flops(model, tokens, layout.recompute, layout.recompute_every)
    seconds = step.total_s
    peak = (
        cluster.gpu.bf16_flops if layout.precision == "bf16" else cluster.gpu.fp32_flops
    )  # as metrics/flops.peak_flops
    per_gpu = flops / seconds / layout.world_size
    return Prediction(
        layout=layout,
        ranks=ranks,
        usable_bytes=cluster.usable_bytes,
        step=step,
        tokens_per_s=tokens / seconds,
        tflops_per_gpu=per_gpu / 1e12,
        mfu=per_gpu / peak,
    )
