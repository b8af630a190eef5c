"""The planner's data-parallel gradient all-reduce, by hand: DeepSpeed reduces gradients bucket by bucket, and each
bucket is a collective that pays its ring's latency (plan/timing.StepModel._reduce_calls). gpt-1.3b in fp32 on 2
nodes of 8 H100s joined at 100 Gb/s, where the all-reduce is exposed at the end of the step."""

import dataclasses

import pytest

from megatron_lite.cli import load
from megatron_lite.layout import Layout
from megatron_lite.plan import cluster_from_config, predict
from megatron_lite.plan.hardware import INTER_LATENCY_S
from megatron_lite.plan.params import rank_params
from megatron_lite.plan.timing import OURS

WORLD = 16
BASE = [
    "model=gpt-1.3b",
    "train.precision=fp32",
    "train.micro_batch_size=1",
    f"train.global_batch_size={WORLD}",
    "cluster.gpu=h100-sxm",
    "cluster.inter_node_GBps=12.5",
]


def _ring_all_reduce(nbytes: float, calls: int) -> float:
    """2 (n-1)/n of the bytes across the node boundary (the one ring of 16 has the whole of each node's 12.5 GB/s),
    and 2 (n-1) hops per collective (the ring's bandwidth term, 1.875x the bytes, beats the tree's 2x by far more
    than its latency)."""
    return 2 * (WORLD - 1) / WORLD * nbytes / 12.5e9 + calls * 2 * (WORLD - 1) * INTER_LATENCY_S


@pytest.mark.parametrize(
    "stage, bucket",
    [(0, 500_000_000), (1, 50_000_000)],  # ZeRO-0: the engine's fallback's 5e8; ZeRO-1: reduce_bucket_size
)
def test_the_gradient_all_reduce_pays_latency_per_bucket(stage, bucket):
    cfg = load([*BASE, f"zero.stage={stage}"], world_size=WORLD)
    layout = Layout.of_run(cfg, WORLD, cuda=True)
    cluster = cluster_from_config(cfg.cluster, WORLD)
    params = rank_params(cfg.model, 1, 1, 1, 0).numel
    calls = -(-params // bucket)
    assert calls == {0: 3, 1: 27}[stage]  # 1.31e9 parameters
    step = predict(cfg.model, layout, cluster, OURS).step
    one_buffer = predict(cfg.model, layout, cluster, dataclasses.replace(OURS, reduce_buckets=False)).step
    # ZeRO-1 then all-gathers the updated fp32 partitions: in both, so their difference is the latency alone
    assert step.dp_s - one_buffer.dp_s == pytest.approx((calls - 1) * 2 * (WORLD - 1) * INTER_LATENCY_S, rel=1e-9)
    if stage == 0:
        assert step.dp_s == pytest.approx(_ring_all_reduce(params * 4, calls), rel=1e-12)
