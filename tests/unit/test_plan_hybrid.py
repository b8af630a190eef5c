"""The planner prices hybrid sharding (zero.shard_size) and hpZ (zero.hpz), for gpt-1.3b in bf16 ZeRO-3 on 2 nodes
of 8 H100s (the states themselves are measured exact on CPU: tests/distributed/test_plan_validation.py).

Hybrid sharding is, to every rank, ZeRO over its own group plus one all-reduce over the replicas: its memory is a
one-node run's, its time that run's plus the replicas' average across the nodes. hpZ keeps ZeRO-3 over all 16
ranks and moves the backward's gathers into a node.
"""

import pytest

from megatron_lite.cli import load
from megatron_lite.layout import Layout
from megatron_lite.plan import cluster_from_config, predict
from megatron_lite.plan.params import rank_params
from megatron_lite.plan.states import MAX_LIVE

# Nodes joined at 100 Gb/s, one micro-batch of 2048 tokens: ZeRO-3's gathers across nodes outlast a backward
BASE = [
    "model=gpt-1.3b",
    "train.precision=bf16",
    "zero.stage=3",
    "train.micro_batch_size=1",
    "cluster.gpu=h100-sxm",
    "cluster.inter_node_GBps=12.5",
]


def _predicted(world: int, *extra: str, batch: int):
    cfg = load([*BASE, f"train.global_batch_size={batch}", *extra], world_size=world)
    layout = Layout.of_run(cfg, world, cuda=True)
    return cfg, layout, predict(cfg.model, layout, cluster_from_config(cfg.cluster, world))


def test_hybrid_sharding_is_one_node_of_zero3_plus_the_replicas_average():
    _, _, one_node = _predicted(8, batch=16)  # 2 micro-batches a step on each rank, as below
    cfg, layout, hybrid = _predicted(16, "zero.shard_size=8", batch=32)
    _, _, plain = _predicted(16, batch=32)
    assert (layout.zero_partitions, layout.replicas) == (8, 2)
    assert hybrid.ranks[0].states == one_node.ranks[0].states  # DeepSpeed partitions over the 8 of one group
    assert plain.ranks[0].optimizer < hybrid.ranks[0].optimizer  # over 16: half of each partition
    partition = rank_params(cfg.model, 1, 1, 1, 0).numel / 8
    cluster = cluster_from_config(cfg.cluster, 16)
    average = cluster.link(2, 8).all_reduce(partition * 4, 2)  # fp32, one rank per node, once a step
    # across the nodes: the 8 replica groups of a node share its network
    assert average > 0 and cluster.link(2, 8).bandwidth == 12.5e9 / 8
    assert hybrid.step.dp_s == pytest.approx(one_node.step.dp_s + average, rel=1e-12)
    assert hybrid.step.dp_s < plain.step.dp_s, (hybrid.step, plain.step)  # the gathers stay in the node


def test_hpz_gathers_for_backward_inside_the_node():
    _, _, plain = _predicted(16, batch=32)
    cfg, layout, hpz = _predicted(16, "zero.hpz=8", batch=32)
    assert layout.zero_partitions == 16
    assert hpz.ranks[0].states == plain.ranks[0].states  # 1.3B parameters: DeepSpeed releases none (states.py)
    params = rank_params(cfg.model, 1, 1, 1, 0).numel
    cluster = cluster_from_config(cfg.cluster, 16)
    # DeepSpeed re-gathers in backward only what its 1e9-element live window released: 0.3B of gpt-1.3b's 1.3B,
    # in as many of the 4 x 24 + 2 module gathers as those elements make up
    regather = params - MAX_LIVE
    calls = -(-(4 * 24 + 2) * regather // params)
    saved = cluster.link(16, 1).gather(regather * 2, 16, calls) - cluster.link(8, 1).gather(regather * 2, 8, calls)
    # that gather, once per micro-batch, no longer crosses nodes (exposed in both: both outlast a backward)
    assert 0.2e9 < regather < 0.4e9 and saved > 0 and hpz.step.dp_s > 0
    assert plain.step.dp_s - hpz.step.dp_s == pytest.approx(layout.accumulation * saved, rel=1e-9)


def test_zero3_regathers_nothing_in_backward_below_the_live_window():
    """gpt2-350m (0.35B parameters) stays gathered from its forward to its backward (DeepSpeed's 1e9-element
    max_live_parameters and reuse distance): hpZ, which only serves the backward's gathers, changes no time."""
    base = ["model=gpt2-350m", "train.micro_batch_size=1", "train.global_batch_size=32"]
    _, _, plain = _predicted(16, *base, batch=32)
    _, _, hpz = _predicted(16, *base, "zero.hpz=8", batch=32)
    assert plain.step.dp_s > 0  # the forward's gathers across 12.5 GB/s outlast its compute
    assert plain.step.dp_s == hpz.step.dp_s and plain.step.total_s == hpz.step.total_s
