"""Bytes per collective per training step, measured by wrapping torch.distributed, against the analytic count.

    python tools/bench_comm.py                 # starts 4 gloo ranks itself (torchrun), tiny model, fp32
    python tools/bench_comm.py --out bench/results/comm_cpu.json

Every torch.distributed collective that our layers and DeepSpeed call during one optimizer step is recorded
with its group and its tensor size. Sizes are turned into *bus bytes* per rank with the ring-algorithm
factors (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the full tensor), which is what
makes an all-reduce and an all-gather + reduce-scatter pair comparable.

Analytic references, per micro-batch, for a model with L layers, activations of b*s*h elements, vocab V:
  TP (Megatron, Shoeybi et al. 2019): 4 all-reduces of b*s*h per layer (2 forward, 2 backward), plus the
      vocab-parallel embedding (1 forward), the head input (1 backward) and the cross entropy (3 of b*s).
  TP + SP (Korthikanti et al. 2022): the same bytes as all-gathers + reduce-scatters, plus the norm-gain
      gradient all-reduces (sizes h) that sequence parallelism adds.
  ZeRO over DP with Psi parameters (Rajbhandari et al. 2020): stage 1/2 move 2*Psi*(n-1)/n per step (the
      all-reduce volume, as reduce-scatter of gradients + all-gather of parameters), stage 3 adds one more
      parameter all-gather: 3*Psi*(n-1)/n (1.5x).
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

WRAPPED = {  # function -> (kind, position of the sized tensor, position of `group`, bus bytes per sized byte)
    "all_reduce": ("all_reduce", 0, 2, lambda n: 2 * (n - 1) / n),
    "all_gather_into_tensor": ("all_gather", 0, 2, lambda n: (n - 1) / n),  # output = full tensor
    "_all_gather_base": ("all_gather", 0, 2, lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("reduce_scatter", 1, 3, lambda n: (n - 1) / n),  # input = full tensor
    "_reduce_scatter_base": ("reduce_scatter", 1, 3, lambda n: (n - 1) / n),
    "all_gather": ("all_gather", 1, 2, lambda n: n - 1),  # input = one rank's share
    "reduce_scatter": ("reduce_scatter", 1, 3, lambda n: (n - 1) / n),  # input list = full tensor
    "broadcast": ("broadcast", 0, 2, lambda n: 1.0),
}


class CommCounter:
    """Wraps torch.distributed collectives; records bus bytes per (group name, kind) while `active`."""

    def __init__(self, groups: dict):
        self.groups, self.active = groups, False
        self.bytes = defaultdict(float)
        for name, (kind, idx, group_idx, factor) in WRAPPED.items():
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), kind, idx, group_idx, factor))

    def _group_name(self, group) -> str:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        return next((name for name, r in self.groups.items() if r == ranks), f"ranks{ranks}")

    def _wrap(self, fn, kind, idx, group_idx, factor):
        names = {
            0: ("tensor", "output_tensor", "output", "tensor_list"),
            1: ("input_tensor", "input", "input_list", "tensor"),
        }

        def wrapped(*args, **kwargs):
            if self.active:
                group = args[group_idx] if len(args) > group_idx else kwargs.get("group")
                tensor = args[idx] if len(args) > idx else next(kwargs[k] for k in names[idx] if k in kwargs)
                numel = (
                    sum(t.numel() * t.element_size() for t in tensor)
                    if isinstance(tensor, (list, tuple))
                    else tensor.numel() * tensor.element_size()
                )
                n = dist.get_world_size(group)
                if n > 1:
                    self.bytes[(self._group_name(group), kind)] += numel * factor(n)
            return fn(*args, **kwargs)

        return wrapped


def tp_analytic(cfg, micro: int, accum: int, tp: int, sp: bool, elem: int) -> float:
    """Bus bytes per rank per step in the TP group (see module docstring)."""
    m, s, h = cfg.model, cfg.model.seq_len, cfg.model.d_model
    bsh = micro * s * h * elem
    ring = 2 * (tp - 1) / tp
    per_micro = (4 * m.n_layers + 2) * bsh * ring + 3 * micro * s * 4 * ring  # CE statistics are fp32
    if sp:
        n_norm_params = (2 * m.n_layers + 1) * h * (2 if m.bias and m.norm == "layernorm" else 1)
        bias_params = 2 * m.n_layers * h if m.bias else 0
        per_micro += (n_norm_params + bias_params) * elem * ring
    return per_micro * accum


def measure(overrides: list[str], counter: CommCounter) -> tuple[dict, object, int]:
    from megatron_lite.cli import load
    from megatron_lite.data.sampler import MicroBatches, open_streams
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.layout import Layout
    from megatron_lite.model.gpt import GPT
    from megatron_lite.model.parallelize import parallelize
    from megatron_lite.parallel.context import ParallelContext
    from megatron_lite.training import run  # noqa: F401  (imports the modules the step needs)

    cfg = load(overrides)
    ctx = ParallelContext.build(cfg.parallel.tp, cfg.parallel.pp)
    counter.groups = {
        "tp": dist.get_process_group_ranks(ctx.tp_group) if ctx.tp_size > 1 else [],
        "dp": dist.get_process_group_ranks(ctx.dp_group) if ctx.dp_size > 1 else [],
    }
    torch.manual_seed(cfg.seed)
    model = parallelize(GPT(cfg.model, tp=ctx.tp_size), ctx.tp_group, cfg.parallel.sp)
    n_params = sum(p.numel() for p in model.parameters())  # this rank's (TP-sharded) parameters
    layout = Layout.of_run(cfg, ctx.world_size)
    engine = Engine(model, ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
    stream = open_streams(cfg.data.path, cfg.data.weights, cfg.model.seq_len, cfg.seed, validation=False).train
    batches = MicroBatches(stream, cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size)
    engine.train_step(batches.next_step(), 1e-3, 1)  # warm-up step (first-use gathers, buffers)
    counter.bytes.clear()
    counter.active = True
    engine.train_step(batches.next_step(), 1e-3, 2)
    counter.active = False
    engine.close()
    return dict(counter.bytes), cfg, n_params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:  # relaunch under torchrun
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={args.nproc}",
            __file__,
            *(argv or sys.argv[1:]),
        ]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")))

    from megatron_lite.parallel.context import init_distributed

    init_distributed()
    world = dist.get_world_size()
    counter = CommCounter({})
    base = [
        "train.precision=fp32",
        "logging.wandb.mode=disabled",
        "train.micro_batch_size=4",
        "checkpoint.resume=never",
    ]
    rows = []
    for tp in (2, 4):
        for sp in (False, True):
            if world % tp:
                continue
            dp = world // tp
            o = base + [f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}", f"train.global_batch_size={4 * dp}"]
            measured, cfg, _ = measure(o, counter)
            got = sum(v for (g, _), v in measured.items() if g == "tp")
            want = tp_analytic(cfg, 4, 1, tp, sp, 4)
            kinds = {k: round(v) for (g, k), v in measured.items() if g == "tp"}
            rows.append(
                {
                    "case": f"tp={tp} sp={sp}",
                    "measured_bus_bytes": round(got),
                    "analytic": round(want),
                    "ratio": round(got / want, 4),
                    "by_kind": kinds,
                }
            )
    for stage in (1, 2, 3):
        tp = max(1, world // 2)  # dp = 2, as the ZeRO comparison asks; count only the DP group
        dp = world // tp
        o = base + [f"parallel.tp={tp}", f"zero.stage={stage}", f"train.global_batch_size={4 * dp}"]
        measured, cfg, n_params = measure(o, counter)
        got = sum(v for (g, _), v in measured.items() if g == "dp")
        ring = (dp - 1) / dp
        want = (3 if stage == 3 else 2) * n_params * 4 * ring
        kinds = {k: round(v) for (g, k), v in measured.items() if g == "dp"}
        rows.append(
            {
                "case": f"zero.stage={stage} dp={dp} tp={tp}",
                "measured_bus_bytes": round(got),
                "analytic": round(want),
                "ratio": round(got / want, 4),
                "by_kind": kinds,
            }
        )
    if dist.get_rank() == 0:
        print(f"{'case':<22}{'measured':>14}{'analytic':>14}{'ratio':>8}  by kind")
        for r in rows:
            print(
                f"{r['case']:<22}{r['measured_bus_bytes']:>14,}{r['analytic']:>14,}{r['ratio']:>8.3f}  {r['by_kind']}"
            )
        if args.out:
            from tools.commit import cpu_record

            record = cpu_record("comm", world=world, model="tiny", precision="fp32", rows=rows)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
