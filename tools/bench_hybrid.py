"""Bytes per training step that cross the node boundary, for ZeRO-2, ZeRO-3, ZeRO-3 with hpZ and hybrid sharding
(zero.shard_size), measured from the collectives a step issues, against the analytic volume.

    python tools/bench_hybrid.py --nproc 4          # 2 "nodes" of 2 gloo ranks
    python tools/bench_hybrid.py --nproc 8 --out bench/results/hybrid_cpu_8.json   # 2 of 4

Ranks r and r' are on one node when r // node_size == r' // node_size (node_size = nproc / 2: torchrun's and
Slurm's placement of consecutive ranks). Every torch.distributed collective of one optimizer step (after a warm-up
step) is recorded with its group, as tools/bench_comm.py does. A collective over n ranks is counted as a ring in
rank order: each of its n edges carries the per-rank bus bytes (all-reduce 2(n-1)/n of the tensor, all-gather and
reduce-scatter (n-1)/n), and the edges between two nodes cross the boundary. The figure is their sum over every
group of the step: the bytes all nodes send to other nodes.

Analytic, for Psi parameters (fp32, 4 bytes each), of which Psi_g are gathered by ZeRO-3 (the rest fall under its
persistence threshold and stay whole), N ranks in k nodes, one ring over all of them crossing k edges:
  ZeRO-2 (DeepSpeed on CPU all-reduces the gradients, then all-gathers the parameters):  k * 3(N-1)/N * 4 Psi
  ZeRO-3 (reduce-scatter; all-gather in forward, kept for backward):                 k * (N-1)/N * 4 (Psi + Psi_g)
  ZeRO-3, gathered again in backward (`_regather`: DeepSpeed's stage3_max_reuse_distance and prefetch bucket 0,
  as a model far past the reuse distance's default of 1e9 elements has it):                                                   k * (N-1)/N * 4 (Psi + 2 Psi_g)
  ZeRO-3 + hpZ, gathered again (the backward gathers inside the node, from the secondary shards): as ZeRO-3 kept
  hybrid sharding, one replica per node (gathers and reductions inside the node; the replica groups, one rank per
  node each, all-reduce their 1/shard of the gradients, N/k groups):                2 (k-1) * 4 Psi
With m micro-batches a step (`_m4`: 4) ZeRO-3 gathers and reduce-scatters m times, hybrid sharding's replicas still
average once. hpZ saves nothing where DeepSpeed keeps the gathered parameters until backward anyway (`zero3_hpz`).
Both sides count the small all-reduces of the loss and the gradient norm on the measured side only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.bench_comm import WRAPPED  # noqa: E402  (after the path insert)


class CrossingCounter:
    """Wraps torch.distributed collectives; while `active`, adds each call's bytes across node boundaries (counted
    on the group's first rank only: every member issues the same call)."""

    def __init__(self, node_size: int):
        self.node_size, self.active, self.crossing = node_size, False, defaultdict(float)
        # Both names of each: DeepSpeed's coalesced ZeRO-3 gathers call distributed_c10d's directly
        for module in (dist, dist.distributed_c10d):
            for name, (kind, idx, group_idx, factor) in WRAPPED.items():
                if hasattr(module, name):
                    setattr(module, name, self._wrap(getattr(module, name), kind, idx, group_idx, factor))

    def _wrap(self, fn, kind, idx, group_idx, factor):
        def wrapped(*args, **kwargs):
            if self.active:
                group = args[group_idx] if len(args) > group_idx else kwargs.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
                if len(ranks) > 1 and ranks[0] == dist.get_rank():
                    tensor = (
                        args[idx]
                        if len(args) > idx
                        else next(
                            iter(
                                v
                                for k, v in kwargs.items()
                                if "tensor" in k or k in ("input", "output", "input_list", "tensor_list")
                            )
                        )
                    )
                    size = (
                        sum(t.numel() * t.element_size() for t in tensor)
                        if isinstance(tensor, (list, tuple))
                        else tensor.numel() * tensor.element_size()
                    )
                    n = len(ranks)
                    edges = sum(ranks[i] // self.node_size != ranks[(i + 1) % n] // self.node_size for i in range(n))
                    self.crossing[kind] += edges * size * factor(n)
            return fn(*args, **kwargs)

        return wrapped


def step_crossing(overrides: list[str], zero_extra: dict, counter: CrossingCounter) -> tuple[dict, int, int]:
    """({kind: bytes across nodes, summed over the world}, Psi, Psi_g) of one step of the run `overrides` selects,
    with `zero_extra` added to DeepSpeed's zero_optimization config."""
    from megatron_lite.cli import load
    from megatron_lite.data.sampler import MicroBatches, open_streams
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.engine.zero_init import zero3_partitioner
    from megatron_lite.layout import Layout
    from megatron_lite.model.build import build_model
    from megatron_lite.parallel.context import ParallelContext

    cfg = load(overrides)
    layout = Layout.of_run(cfg, dist.get_world_size())
    ctx = ParallelContext.build(layout.tp, layout.pp, layout.cp, layout.hpz, layout.shard_size)
    ds_config = deepspeed_config(cfg, layout)
    ds_config["zero_optimization"].update(zero_extra)
    partition, dtype = zero3_partitioner(ds_config, ctx) if layout.zero_stage == 3 else (None, torch.float32)
    model = build_model(cfg, ctx, layout, dtype=dtype, partition=partition)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    psi_g = sum(p.ds_numel for p in model.parameters() if not getattr(p, "ds_persist", True))
    engine = Engine(model, ctx, layout, ds_config, model_cfg=cfg.model, train=cfg.train)
    stream = open_streams(cfg.data.path, cfg.data.weights, cfg.model.seq_len, cfg.seed, validation=False).train
    batches = MicroBatches(stream, cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size)
    engine.train_step(batches.next_step(), 1e-3, 1)  # warm-up (first-use gathers, buffers)
    counter.crossing.clear()
    counter.active = True
    engine.train_step(batches.next_step(), 1e-3, 2)
    counter.active = False
    engine.close()
    ctx.destroy()
    kinds = sorted({kind for kind, *_ in WRAPPED.values()})  # the same list on every rank
    totals = torch.tensor([counter.crossing[k] for k in kinds], dtype=torch.float64)
    dist.all_reduce(totals)
    return {k: v for k, v in zip(kinds, totals.tolist()) if v}, psi, psi_g


def analytic(case: str, world: int, nodes: int, psi: int, psi_g: int) -> float:
    ring = (world - 1) / world
    hsdp = 2 * (nodes - 1) * 4 * psi
    if case.endswith("_m4"):  # 4 micro-batches: ZeRO-3 gathers and reduce-scatters for each, HSDP averages once
        return hsdp if "hsdp" in case else 4 * analytic(case[:-3], world, nodes, psi, psi_g)
    return {
        "zero2": nodes * 3 * ring * 4 * psi,
        "zero3": nodes * ring * 4 * (psi + psi_g),  # gathered once: kept until backward
        "zero3_hpz": nodes * ring * 4 * (psi + psi_g),
        "zero3_regather": nodes * ring * 4 * (psi + 2 * psi_g),
        "zero3_hpz_regather": nodes * ring * 4 * (psi + psi_g),  # the backward's gathers stay in the node
        "zero2_hsdp": hsdp,
        "zero3_hsdp": hsdp,
        "zero3_hsdp_regather": hsdp,
    }[case]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args([a for a in (argv or sys.argv[1:]) if a != "--"])
    if "RANK" not in os.environ:  # relaunch under torchrun
        # (the options go after a "--": torchrun takes an abbreviation of its own for --nproc anywhere)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", __file__, "--"]
        cmd += argv or sys.argv[1:]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")))

    from megatron_lite.parallel.context import init_distributed

    init_distributed()
    world, nodes = dist.get_world_size(), 2
    node = world // nodes
    counter = CrossingCounter(node)
    base = [
        "train.precision=fp32",
        "logging.wandb.mode=disabled",
        "checkpoint.resume=never",
        "model.d_model=256",  # past ZeRO-3's persistence threshold: its weights are gathered (tests/distributed/test_zero.py)
        "train.micro_batch_size=2",
        f"train.global_batch_size={2 * world}",
    ]
    # A large model in this small one: with a reuse distance of 0 and no prefetch DeepSpeed releases each parameter
    # after its forward and gathers it again in backward (its default reuse distance, 1e9 elements, keeps the
    # parameters of a model this small until backward; measured: with prefetching on, a reuse distance of 0 alone
    # still gathered once a step)
    regather = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    cases = {
        "zero2": (["zero.stage=2"], {}),
        "zero3": (["zero.stage=3"], {}),
        "zero3_hpz": (["zero.stage=3", f"zero.hpz={node}"], {}),
        "zero3_regather": (["zero.stage=3"], regather),
        "zero3_hpz_regather": (["zero.stage=3", f"zero.hpz={node}"], regather),
        "zero2_hsdp": (["zero.stage=2", f"zero.shard_size={node}"], {}),
        "zero3_hsdp": (["zero.stage=3", f"zero.shard_size={node}"], {}),
        "zero3_hsdp_regather": (["zero.stage=3", f"zero.shard_size={node}"], regather),
        "zero3_m4": (["zero.stage=3", f"train.global_batch_size={8 * world}"], {}),
        "zero3_hsdp_m4": (["zero.stage=3", f"zero.shard_size={node}", f"train.global_batch_size={8 * world}"], {}),
    }
    rows = []
    for case, (extra, zero_extra) in cases.items():
        measured, psi, psi_g = step_crossing(base + extra, zero_extra, counter)
        got, want = sum(measured.values()), analytic(case, world, nodes, psi, psi_g)
        rows.append(
            {
                "case": case,
                "overrides": extra,
                "deepspeed_zero_extra": zero_extra,
                "crossing_bytes": round(got),
                "analytic": round(want),
                "ratio": round(got / want, 4),
                "by_kind": {k: round(v) for k, v in measured.items()},
                "psi": psi,
                "psi_gathered": psi_g,
            }
        )
    if dist.get_rank() == 0:
        zero3 = next(r["crossing_bytes"] for r in rows if r["case"] == "zero3")
        print(f"{world} ranks as {nodes} nodes of {node}; bytes a step sends across the node boundary (all nodes)")
        print(f"{'case':<20}{'measured':>14}{'analytic':>14}{'ratio':>8}{'vs zero3':>10}  by kind")
        for r in rows:
            print(
                f"{r['case']:<20}{r['crossing_bytes']:>14,}{r['analytic']:>14,}{r['ratio']:>8.3f}"
                f"{r['crossing_bytes'] / zero3:>10.3f}  {r['by_kind']}"
            )
        if args.out:
            from tools.commit import cpu_record

            record = cpu_record(
                "hybrid", world=world, nodes=nodes, model="gpt-tiny, d_model 256", precision="fp32", rows=rows
            )
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)
