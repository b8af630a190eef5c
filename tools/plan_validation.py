"""The planner's memory model against measured memory, per rank, for layouts of the tiny presets on CPU (gloo).

    python tools/plan_validation.py --out bench/results/plan_validation_cpu.md    # about 6 minutes on 2 cores

Every rank builds its model and engine as training.run does, with megatron_lite.metrics.memory.LiveTensorBytes active from
before the model exists, and trains 3 steps; step 3 is measured (steps 1 and 2 allocate what is made lazily):
  states      live bytes at the step boundary, split into the model's parameters (every storage a parameter or a
              ZeRO-3 partition points into), the optimizer's (master weights and states of the optimizer DeepSpeed
              wraps) and the rest (gradient buffers, buckets, scalars); compared with plan/states.py, exactly
  activations the most bytes autograd kept for backward at once (a saved-tensor hook notes each storage saved,
              parameters and buffers excluded; a weak reference drops it when freed); vs plan/activations.py times
              the schedule's in-flight micro-batches
  peak        the tracker's peak live bytes in the step; vs plan/memory.py's peak (states + held gradients,
              buckets and activations + the backward's or the optimizer step's transients)
CPU offload counts host bytes, which here are the same memory. The pipeline bubble is compared separately: the
planner's (the simulator's) against tools/bench_pipeline.py's measured bubbles (bench/results/pipeline_cpu.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASE = [
    "logging.wandb.mode=disabled",
    "checkpoint.resume=never",
    "train.precision=fp32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
]
LLAMA = "model=llama-tiny"
# (ranks, overrides): every axis, ZeRO 0-3, recompute modes, vpp, cp ring and Ulysses, offload, both flavours, bf16.
# ZeRO-3 layouts come last in each world: DeepSpeed's zero.Init replaces torch.nn.functional.linear for the rest of
# the process ("This will persist unless manually reset"), and its linear keeps other tensors for backward than
# autocast's (ZeRO-0 bf16) -- a training process runs one configuration, so it never meets this.
LAYOUTS: list[tuple[int, list[str]]] = [
    (2, ["zero.stage=0"]),
    (2, ["zero.stage=1"]),
    (2, ["zero.stage=2"]),
    (2, ["zero.stage=1", "train.recompute=selective"]),
    (2, ["zero.stage=2", "train.recompute=full"]),
    (2, ["zero.stage=0", "train.recompute=full", "train.recompute_every=2", "model.dropout=0.1"]),
    (2, ["zero.stage=1", "model.dropout=0.1"]),
    (2, [LLAMA, "zero.stage=1"]),
    (2, [LLAMA, "zero.stage=2", "train.precision=bf16"]),
    (2, ["zero.stage=1", "train.precision=bf16"]),
    (2, ["zero.stage=0", "train.precision=bf16"]),
    (2, ["parallel.pp=2", "zero.stage=0", "train.precision=bf16", "train.global_batch_size=16"]),
    (2, ["zero.stage=2", "zero.offload_optimizer=cpu"]),
    (2, ["parallel.cp=2", "zero.stage=1"]),
    (2, ["parallel.cp=2", "parallel.cp_mode=ulysses", LLAMA, "zero.stage=2"]),
    (2, ["parallel.tp=2", "parallel.sp=true", "zero.stage=0"]),
    (2, ["parallel.tp=2", "zero.stage=1"]),
    (2, ["parallel.pp=2", "zero.stage=1"]),
    (2, ["parallel.pp=2", "parallel.vpp=2", "zero.stage=1", "train.global_batch_size=16"]),
    (2, ["zero.stage=3"]),
    (2, ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"]),
    (4, ["parallel.tp=2", "parallel.sp=true", "zero.stage=2"]),
    (4, ["parallel.pp=4", "zero.stage=1", "train.global_batch_size=16"]),
    (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", LLAMA, "zero.stage=1", "train.recompute=full"]),
    (4, ["parallel.pp=2", "parallel.schedule=gpipe", "zero.stage=2", "train.global_batch_size=16"]),
    (4, ["parallel.cp=2", "zero.stage=2", "model.dropout=0.1"]),
    (
        4,
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.tp=2",
            "zero.stage=1",
            "train.global_batch_size=16",
            "train.recompute=selective",
        ],
    ),
    (4, ["parallel.tp=2", "parallel.cp=2", "zero.stage=3"]),
    (4, ["zero.stage=2", "zero.shard_size=2", "train.global_batch_size=16"]),
    # (d_model 256: past ZeRO-3's persistence threshold, so parameters are gathered)
    (4, ["zero.stage=3", "zero.shard_size=2", "model.d_model=256", "train.global_batch_size=16"]),
    (4, ["zero.stage=3", "zero.hpz=2", "model.d_model=256", "train.global_batch_size=16"]),
]


# --- measuring, on every rank --------------------------------------------------------------------------------


def _storages(tensors) -> dict[int, int]:
    import torch

    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


class SavedBytes:
    """Live bytes of the storages autograd keeps for backward (parameters and buffers excluded), and their peak."""

    def __init__(self, model):
        self.model, self.live, self.peak, self._refs = model, 0, 0, {}

    def pack(self, t):
        import torch

        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs or isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        if storage.data_ptr() in {
            q.untyped_storage().data_ptr() for q in (*self.model.parameters(), *self.model.buffers())
        }:
            return t
        size = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.live += size
        self.peak = max(self.peak, self.live)
        return t

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)


def measure_one(overrides: list[str], contexts: dict) -> dict:
    """This rank's states, activation peak and peak for one layout (module docstring)."""
    import torch
    import torch.distributed as dist

    from megatron_lite.cli import load
    from megatron_lite.data.sampler import MicroBatches, open_streams
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.engine.zero_init import zero3_partitioner
    from megatron_lite.layout import Layout
    from megatron_lite.metrics.memory import LiveTensorBytes
    from megatron_lite.model.build import build_model
    from megatron_lite.parallel.context import ParallelContext

    cfg = load(overrides)
    layout = Layout.of_run(cfg, dist.get_world_size())
    groups = (layout.tp, layout.pp, layout.cp, layout.hpz, layout.shard_size)
    if groups not in contexts:
        contexts[groups] = ParallelContext.build(*groups)
    ctx = contexts[groups]
    tracker = LiveTensorBytes()
    with tracker:
        partition, dtype = None, torch.float32
        if cfg.zero.stage == 3:
            partition, dtype = zero3_partitioner(deepspeed_config(cfg, layout), ctx)
        model = build_model(cfg, ctx, layout, dtype=dtype, partition=partition)
        model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
        engine = Engine(model, ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
        stream = open_streams(cfg.data.path, cfg.data.weights, cfg.model.seq_len, cfg.seed, validation=False).train
        batches = MicroBatches(
            stream, cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size
        )
        for step in (1, 2):
            engine.train_step(batches.next_step(), 1e-3, step)
        live = tracker.storages()
        params = _storages([*model.parameters(), *(getattr(q, "ds_tensor", None) for q in model.parameters())])
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        optimizer = _storages(
            [
                *(q for g in inner.param_groups for q in g["params"]),
                *(v for state in inner.state.values() for v in state.values()),
                *getattr(engine.optimizer, "fp32_partitioned_groups_flat", []),
            ]
        )  # ZeRO-3's master
        record = {
            "rank": dist.get_rank(),
            "pp_rank": ctx.pp_rank,
            "boundary": tracker.live,
            "params": sum(n for ptr, n in live.items() if ptr in params),
            "optimizer": sum(n for ptr, n in live.items() if ptr in optimizer and ptr not in params),
        }
        record["rest"] = record["boundary"] - record["params"] - record["optimizer"]
        saved = SavedBytes(model)
        tracker.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            engine.train_step(batches.next_step(), 1e-3, 3)
        record.update(peak=tracker.peak, activations=saved.peak)
        engine.close()
    return record


def worker(spec_path: str) -> None:
    import torch.distributed as dist

    from megatron_lite.parallel.context import init_distributed

    with open(spec_path) as f:
        spec = json.load(f)
    init_distributed()
    contexts, results = {}, []
    for overrides in spec["runs"]:
        mine = measure_one(overrides, contexts)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append({"overrides": overrides, "ranks": every})
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# --- launching and comparing, in the caller -------------------------------------------------------------------


def measure(nproc: int, runs: list[list[str]], scratch: str, env: dict | None = None) -> list[dict]:
    """Measure each override list (BASE added) in one nproc-rank torchrun world; every rank's records."""
    from megatron_lite.parallel.context import free_port, torchrun_env

    spec = os.path.join(scratch, f"plan_{nproc}_{len(os.listdir(scratch))}.json")
    out = spec.replace(".json", ".out.json")
    with open(spec, "w") as f:
        json.dump({"runs": [BASE + r for r in runs], "out": out}, f)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        __file__,
        "--worker",
        spec,
    ]
    base_env = torchrun_env(ROOT)
    proc = subprocess.run(cmd, env={**base_env, **(env or {})}, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def compare(result: dict, nproc: int) -> list[dict]:
    """Predicted vs measured per pipeline stage (the worst measured rank of each stage; the planner prices the
    worst too: DeepSpeed's padding and ZeRO-2's overlapping parameters make dp ranks differ slightly)."""
    from megatron_lite.cli import load
    from megatron_lite.layout import Layout
    from megatron_lite.plan.memory import rank_memory

    cfg = load(result["overrides"], world_size=nproc)
    lay = Layout.of_run(cfg, nproc)  # this machine's precision, as it ran
    rows = []
    for stage in sorted({r["pp_rank"] for r in result["ranks"]}):
        measured = [r for r in result["ranks"] if r["pp_rank"] == stage]
        worst = {key: max(r[key] for r in measured) for key in ("params", "optimizer", "rest", "activations", "peak")}
        pred = rank_memory(cfg.model, lay, stage, cuda=False)
        predicted = {
            "params": pred.params + pred.host_params,
            "optimizer": pred.optimizer + pred.host_optimizer,
            "rest": pred.grads + pred.buffers + pred.host - pred.host_optimizer - pred.host_params,
            "activations": pred.held,
            "peak": pred.peak + pred.host,
        }
        rows.append(
            {
                "layout": " ".join(o for o in result["overrides"] if o not in BASE),
                "ranks": nproc,
                "pp_rank": stage,
                "phase": pred.phase,
                "measured": worst,
                "predicted": predicted,
            }
        )
    return rows


def bubble_rows(path: str = os.path.join(ROOT, "bench", "results", "pipeline_cpu.json")) -> list[dict]:
    """The planner's bubble (plan/timing.schedule_bubble) against tools/bench_pipeline.py's measured ones."""
    from megatron_lite.plan.timing import schedule_bubble

    with open(path) as f:
        bench = json.load(f)
    return [
        {
            "schedule": r["schedule"],
            "pp": bench["pp"],
            "vpp": r["vpp"],
            "m": r["m"],
            "measured": r["measured"],
            "predicted": schedule_bubble(r["schedule"], bench["pp"], r["vpp"], r["m"]),
        }
        for r in bench["rows"]
    ]


def markdown(rows: list[dict], bubbles: list[dict], commit: str) -> str:
    def pct(p, m):
        return f"{100 * (p / m - 1):+.1f}%" if m else "n/a"

    lines = [
        "# Planner memory model vs measured memory, CPU (tools/plan_validation.py)",
        "",
        f"- Date {datetime.date.today().isoformat()}, commit `{commit}`, CPU (2 cores), gloo, tiny presets "
        "(micro-batch 4, global batch 8 unless the layout says), fp32 unless it says bf16.",
        "- Bytes per rank of step 3; each pipeline stage's fullest rank. states = parameters + optimizer + rest "
        "(gradient buffers, buckets, scalars): predicted vs measured difference in bytes; activations = most "
        "bytes autograd keeps at once; peak = live tensor bytes at the step's peak.",
        "",
        "| # | ranks | layout | pp rank | states (measured) | states off by | activations meas / pred | peak meas "
        "/ pred | peak at |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        m, p = r["measured"], r["predicted"]
        states_m = m["params"] + m["optimizer"] + m["rest"]
        states_p = p["params"] + p["optimizer"] + p["rest"]
        lines.append(
            f"| {i} | {r['ranks']} | `{r['layout']}` | {r['pp_rank']} | {states_m:,} | {states_p - states_m:+,} B "
            f"| {m['activations'] / 2**20:.2f} / {p['activations'] / 2**20:.2f} MiB "
            f"({pct(p['activations'], m['activations'])}) | {m['peak'] / 2**20:.1f} / {p['peak'] / 2**20:.1f} "
            f"MiB ({pct(p['peak'], m['peak'])}) | {r['phase']} |"
        )
    lines += [
        "",
        "## Pipeline bubble: the planner's (the schedule simulator's) vs measured by tools/bench_pipeline.py",
        "",
        "(stand-in chunks of equal cost, pp = 4; bench/results/pipeline_cpu.json)",
        "",
        "| schedule | vpp | m | measured | predicted | predicted / measured |",
        "|---|---|---|---|---|---|",
    ]
    for b in bubbles:
        lines.append(
            f"| {b['schedule']} | {b['vpp']} | {b['m']} | {b['measured']:.3f} | {b['predicted']:.3f} | "
            f"{b['predicted'] / b['measured']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="markdown table path (a .json with the rows is written beside it)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc in sorted({n for n, _ in LAYOUTS}):
            for result in measure(nproc, [o for n, o in LAYOUTS if n == nproc], scratch):
                rows += compare(result, nproc)
    from tools.commit import git_commit

    text = markdown(rows, bubble_rows(), git_commit())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"rows": rows, "bubbles": bubble_rows()}, f, indent=1)


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
