"""Peak host memory per rank while building a model: the whole model, the old route (build all, then cut and
shard), and model/build.py (build on meta, materialise only this rank's share).

    python tools/bench_build_memory.py                 # gpt-1.3b, every case, prints a table
    python tools/bench_build_memory.py --out bench/results/build_memory_cpu.md

Each case is a fresh torchrun world of gloo ranks on this machine, so the numbers are per process. What is
measured: the resident set size before the build (VmRSS from /proc/self/status, after imports and process
groups) and its high-water mark after it (getrusage ru_maxrss, which the kernel keeps for the whole process);
their difference is the build's peak. RSS, not tracemalloc: torch allocates tensors with its own allocator,
which tracemalloc does not see. "Held" counts the parameter bytes the rank keeps (its ZeRO-3 partition, where
partitioned).

Ranks of the TP/PP cases take turns (a barrier between them): building involves no collective, and one whole
model at a time keeps a 4-rank run of the old route inside a small machine's memory. The ZeRO-3 cases run
their ranks together, because partitioning broadcasts each parameter over the DP group.

The old route is reproduced for its memory: every parameter of the whole model allocated at once and drawn in
place (as the module constructors and the old reset_parameters did, with no second copy), then GPT.keep_chunks
and parallelize.

Left out on purpose: GPU memory (the same build, placed on the device, allocates there in the same proportion).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MIB = 2**20
# name -> (tp, pp, dp, route); route: whole (build_model at tp = pp = 1), old, meta, zero3-old, zero3-meta
CASES = {
    "tp1 pp1, old route": (1, 1, 1, "old"),
    "tp1 pp1, meta build": (1, 1, 1, "meta"),
    "tp2 pp2, old route": (2, 2, 1, "old"),
    "tp2 pp2, meta build": (2, 2, 1, "meta"),
    "zero3 dp2, engine partitions the built model": (1, 1, 2, "zero3-old"),
    "zero3 dp2, partitioned as built": (1, 1, 2, "zero3-meta"),
}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@torch.no_grad()
def old_route(cfg, ctx):
    """The trainer's construction before model/build.py: the whole fp32 model allocated and initialised in
    place on every rank, then cut to the rank's chunks and sharded."""
    from megatron_lite.model.gpt import GPT
    from megatron_lite.model.parallelize import parallelize
    from megatron_lite.pipeline.partition import rank_chunks

    model = GPT(cfg.model, tp=ctx.tp_size, seed=cfg.seed, device="meta").to_empty(device="cpu")
    for name, p in model.named_parameters():  # in place, no second copy (as nn.Linear + reset_parameters did)
        if p.dim() == 1:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.normal_(0.0, cfg.model.init_std)
    model.materialize("cpu")  # the rope buffers, if any
    model.keep_chunks(rank_chunks(ctx.pp_rank, ctx.pp_size, cfg.parallel.vpp, cfg.model.n_layers))
    return parallelize(model, ctx.tp_group, cfg.parallel.sp)


def build(route: str, cfg, ctx):
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.engine.zero_init import zero3_partitioner
    from megatron_lite.layout import Layout
    from megatron_lite.model.build import build_model

    layout = Layout.of_run(cfg, ctx.world_size)
    if route == "old":
        return old_route(cfg, ctx)
    if route == "meta":
        return build_model(cfg, ctx, layout)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ds_config = deepspeed_config(cfg, layout)
    if route == "zero3-old":  # what DeepSpeed's ZeRO-3 setup does with the model it is handed
        model = old_route(cfg, ctx)
        deepspeed.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False
        )
        deepspeed.zero.Init(
            module=model,
            data_parallel_group=ctx.dp_group,
            config_dict_or_path=ds_config,
            dtype=torch.float32,
            mpu=ctx.mpu(),
        )
        return model
    partition, dtype = zero3_partitioner(ds_config, ctx)
    return build_model(cfg, ctx, layout, dtype=dtype, partition=partition)


def held_bytes(model) -> int:
    return sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in model.parameters())


def rank_main(args) -> None:
    from megatron_lite.cli import load
    from megatron_lite.parallel.context import ParallelContext, init_distributed

    tp, pp, dp, route = CASES[args.case]
    cfg = load(
        [
            f"model={args.model}",
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            "train.precision=fp32",
            f"zero.stage={3 if route.startswith('zero3') else 0}",
            "checkpoint.resume=never",
            "logging.wandb.mode=disabled",
            "train.micro_batch_size=1",
            f"train.global_batch_size={dp * pp}",
        ]
    )
    init_distributed()
    ctx = ParallelContext.build(tp, pp)
    together = route.startswith("zero3")
    # A small model first, by the same route: the libraries it loads and first-use allocations count in the
    # baseline, not in the build.
    small = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model, n_layers=2, n_heads=4, n_kv_heads=None, d_model=64, ffn_hidden=None, vocab_size=512
        ),
    )
    row = {}
    for turn in range(1 if together else ctx.world_size):
        if together or turn == ctx.rank:
            build(route, small, ctx)
            before, start = rss_bytes(), time.perf_counter()
            model = build(route, cfg, ctx)
            row = {
                "build_s": time.perf_counter() - start,
                "rank": ctx.rank,
                "tp_rank": ctx.tp_rank,
                "pp_rank": ctx.pp_rank,
                "dp_rank": ctx.dp_rank,
                "held_mib": held_bytes(model) / MIB,
                "rss_before_mib": before / MIB,
                "peak_rss_mib": peak_rss_bytes() / MIB,
                "build_peak_mib": (peak_rss_bytes() - before) / MIB,
            }
            del model
        dist.barrier()
    rows = [None] * ctx.world_size
    dist.all_gather_object(rows, row)
    if ctx.rank == 0:
        with open(args.rank_out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run_case(case: str, model: str) -> list[dict]:
    from megatron_lite.parallel.context import free_port, torchrun_env

    tp, pp, dp, _ = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={tp * pp * dp}",
            f"--master-port={free_port()}",
            __file__,
            "--case",
            case,
            "--model",
            model,
            "--rank-out",
            out,
        ]
        env = torchrun_env(ROOT)
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def git_state() -> str:
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001 - outside a git checkout
        return "unknown"
    return f"{head} + uncommitted work" if dirty else head


def machine() -> str:
    cpu, mem_gib = "CPU", 0.0
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    with open("/proc/meminfo") as f:
        mem_gib = int(f.readline().split()[1]) / 2**20
    return f"{cpu}, {os.cpu_count()} cores visible, {mem_gib:.0f} GiB RAM"


def report(results: dict[str, list[dict]]) -> str:
    whole = max(r["build_peak_mib"] for r in results["tp1 pp1, old route"])
    lines = [
        "| case | ranks | held per rank (MiB) | build peak per rank (MiB) | max peak / tp1 pp1 old "
        "| max peak / held | build time per rank (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, rows in results.items():
        held = " / ".join(f"{r['held_mib']:.0f}" for r in rows)
        peaks = " / ".join(f"{r['build_peak_mib']:.0f}" for r in rows)
        seconds = " / ".join(f"{r['build_s']:.1f}" for r in rows)
        ratio = max(r["build_peak_mib"] for r in rows) / whole
        over_held = max(r["build_peak_mib"] / r["held_mib"] for r in rows)
        lines.append(f"| {case} | {len(rows)} | {held} | {peaks} | {ratio:.2f} | {over_held:.2f} | {seconds} |")
    before = [r["rss_before_mib"] for rows in results.values() for r in rows]
    lines += [
        "",
        "Build peak = ru_maxrss after the build - VmRSS before it; the RSS before the build (imports, "
        f"process groups, a small model built the same way first) was {min(before):.0f}-{max(before):.0f} MiB "
        "per rank. Per-rank values in global rank order, rank = (pp_rank * dp + dp_rank) * tp + tp_rank. "
        "Held: the parameter bytes the rank keeps (its partition under ZeRO-3).",
        "",
        "Routes: *old* = the trainer's construction before model/build.py (every rank allocates and "
        "initialises the whole fp32 model, then keep_chunks and parallelize; under ZeRO-3, deepspeed.zero.Init "
        "partitions the built model, as the engine does). *meta build* = model/build.py (meta device, cut, "
        "shard, then one full tensor at a time, sliced). *partitioned as built* = the same with "
        "zero_init.zero3_partitioner (each parameter partitioned over DP as soon as it exists). TP/PP ranks build "
        "in turn; ZeRO-3 ranks together.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=None, help="write a markdown report here")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # set on the ranks of one case
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case is not None:
        return rank_main(args)
    if "tp1 pp1, old route" not in args.cases:
        args.cases.insert(0, "tp1 pp1, old route")  # the reference of every ratio
    results = {}
    for case in args.cases:
        results[case] = run_case(case, args.model)
        print(
            f"{case}: build peak per rank " + ", ".join(f"{r['build_peak_mib']:.0f}" for r in results[case]) + " MiB",
            flush=True,
        )
    table = report(results)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"# Peak host memory while building `{args.model}` (fp32), per rank\n\n"
                f"`python tools/bench_build_memory.py --model {args.model}`; {machine()}; gloo ranks on one "
                f"machine; torch {torch.__version__}; {datetime.date.today().isoformat()}; commit "
                f"{git_state()}.\n\n{table}\n"
            )


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
