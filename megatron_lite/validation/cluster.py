"""cluster.*: the GPUs the planner prices (train.py --check / --plan)."""

from __future__ import annotations

import math

from megatron_lite.config import ClusterConfig
from megatron_lite.plan.hardware import gpu_named
from megatron_lite.validation.rules import choice, fail

GPU_CHOICES = ("auto", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200")  # plan/hardware.py's table


def check_cluster(c: ClusterConfig) -> None:
    choice("cluster.gpu", c.gpu, GPU_CHOICES)
    for key in ("gpus_per_node", "nodes"):
        value = getattr(c, key)
        if value is not None and value < 1:
            fail(f"cluster.{key}", value, "must be >= 1", "e.g. cluster.gpus_per_node=8 cluster.nodes=4")
    for key in ("intra_node_GBps", "inter_node_GBps"):
        value = getattr(c, key)
        if value is not None and not 0 < value < math.inf:
            fail(
                f"cluster.{key}",
                value,
                "must be a positive bandwidth in GB/s",
                "e.g. 450, or null for the GPU's default",
            )
    if c.achievable is not None and not 0 < c.achievable <= 1:
        fail("cluster.achievable", c.achievable, "must be a fraction in (0, 1]", "e.g. 0.65")
    gpu_gib = gpu_named(c.gpu).memory_bytes / 2**30
    if not 0 <= c.reserve_gib < gpu_gib:  # NaN too
        fail(
            "cluster.reserve_gib",
            c.reserve_gib,
            f"must be in [0, {gpu_gib:.1f}) GiB, the memory of one {gpu_named(c.gpu).name}",
            "e.g. 2",
        )
