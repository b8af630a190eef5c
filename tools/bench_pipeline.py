"""Executed pipeline bubble against the schedule simulator, and what ZeRO-2 costs over ZeRO-1 under a pipeline.

    python tools/bench_pipeline.py                  # starts 4 gloo ranks itself (torchrun), ~2 minutes on CPU
    python tools/bench_pipeline.py --out bench/results/pipeline_cpu.json
    python tools/bench_pipeline.py --schedules 1f1b zb_h1 --no-zero --out bench/results/zero_bubble_cpu.json

1. Bubble. pp=4, m in {4, 8, 16}: 1f1b, zb_h1 and gpipe at vpp=1, interleaved, zbv and gpipe at vpp=2. The real
   executor
   runs the real schedule and real (b, s, h) tensors through gloo p2p, but every chunk is a stand-in whose
   forward sleeps F/vpp and whose backward sleeps 2F/vpp: compute is uniform and costs no CPU (4 ranks share
   2 cores), so what is measured is the schedule plus the p2p cost, not the layers. Under zb_h1 the backward
   is split as parallel/weight_grad.py splits a layer's: B sleeps F/vpp and queues a W that sleeps F/vpp and
   returns the stand-in's weight gradient, so F = B = W (the paper's setting); zbv too. Per rank the work is
   m*vpp chunk computations, so
       ideal    = m * vpp * (F/vpp + 2F/vpp) = 3*m*F        (the same for every vpp, as the formula assumes)
       measured = (makespan - ideal) / ideal,   makespan = last compute end - first compute start, all ranks
       theory   = simulate(build_schedule(...), f_cost=F/vpp, b_cost=2F/vpp).bubble
                = (pp-1)/m for 1f1b, (pp-1)/(vpp*m) for interleaved and gpipe (pipeline/simulate.py).
   Timelines come from PipelineExecutor.record_timeline (time.perf_counter, i.e. CLOCK_MONOTONIC on Linux:
   one clock for every process on the host, so no offsets are needed; the spread of readings taken right after
   a barrier is recorded, and is scheduling delay, not clock skew). One warm-up step, then --steps measured
   steps; the step with the median makespan is reported and drawn. `busy` is the bubble against the slowest
   rank's summed compute time instead of the nominal ideal: the gap between the two is sleep overshoot and
   Python around each compute.
   The simulator charges nothing for messages: `extra ms/Comm` = (makespan - simulated makespan at the measured
   mean F and B) / (Comm steps of a rank) is what each Comm step cost beyond compute, to set beside one
   measured message hop.
2. ZeRO-1 vs ZeRO-2 at pp=2 x dp=2 (tiny model, fp32, 4 micro-batches per step), through the Engine as
   training.run builds it. tools/bench_comm.py's CommCounter, extended to count calls and to tell the
   schedule (forwards/backwards) from the optimizer step, records every collective of the second step.
   Expected, with Psi parameters on a rank and n = dp: ZeRO-1 all-reduces every gradient once, in step()
   (2*(n-1)/n * 4*Psi bus bytes in fp32), then all-gathers the updated partitions ((n-1)/n * 4*Psi).
   ZeRO-2 reduces in each backward the gradients that backward made: the chunk's blocks m times, the tied
   embedding once (model/tied.py feeds its gradient through one extra backward after the schedule).

Left out: real layers (see bench_throughput.py), overlap of p2p with compute (the executor does not overlap).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_lite.pipeline.schedules import Comm, build_schedule, v_shaped  # noqa: E402
from megatron_lite.pipeline.simulate import expected_bubble, simulate  # noqa: E402
from tools.bench_comm import CommCounter  # noqa: E402
from tools.pipeline_timeline import plot_timeline  # noqa: E402

PP, MS = 4, (4, 8, 16)
CASES = (("1f1b", 1), ("zb_h1", 1), ("gpipe", 1), ("interleaved", 2), ("zbv", 2), ("gpipe", 2))
ACT_SHAPE = (1, 16, 32)  # (b, s, h) of every message
PLOT_M = 8


class _Sleep(torch.autograd.Function):
    """forward: sleep f_s, backward: sleep b_s; identity on the values."""

    @staticmethod
    def forward(ctx, x, f_s, b_s):
        ctx.b_s = b_s
        time.sleep(f_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b_s)
        return grad, None, None


class _SplitSleep(torch.autograd.Function):
    """x * gain under a zero-bubble step: forward sleeps f_s; backward (B) sleeps b_s and returns dx, and queues
    a W that sleeps w_s and returns gain's gradient (as parallel/weight_grad.py's linear does)."""

    @staticmethod
    def forward(ctx, x, gain_stand_in, f_s, b_s, w_s, store, gain):
        ctx.save_for_backward(x, gain_stand_in)
        ctx.costs, ctx.store, ctx.gain = (b_s, w_s), store, gain
        time.sleep(f_s)
        return x * gain_stand_in

    @staticmethod
    def backward(ctx, grad):
        x, gain = ctx.saved_tensors
        b_s, w_s = ctx.costs
        time.sleep(b_s)

        def weight_grad():
            time.sleep(w_s)
            return ((grad * x).sum((0, 1)),)

        ctx.store.defer((ctx.gain,), weight_grad)
        return grad * gain, None, None, None, None, None, None


class StandIn(torch.nn.Module):
    """vpp chunks of fixed wall-clock cost, called as the executor calls the engine: forward(x, labels, chunk=k,
    rng_key=...) (no dropout here, so the key is unused); and forward(None, chunk=WEIGHT_GRADS) for W."""

    def __init__(self, vpp: int, h: int, f_s: float, b_s: float):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(vpp, h))
        self.f_s, self.b_s = f_s, b_s

    def forward(self, x, labels=None, chunk: int = 0, rng_key=None):
        from megatron_lite.parallel import weight_grad

        if chunk == weight_grad.WEIGHT_GRADS:
            return weight_grad.released_output()
        if not x.is_floating_point():  # virtual stage 0: tokens (b, s) -> (b, s, h), in the graph through `gain`
            x = x.unsqueeze(-1).float() * 1e-3
        store = weight_grad.active_store()
        if store is None:
            y = _Sleep.apply(x * self.gain[chunk], self.f_s, self.b_s)
        else:  # B and W each half the backward
            gain = self.gain[chunk]
            y = _SplitSleep.apply(x, weight_grad.stand_in(gain), self.f_s, self.b_s / 2, self.b_s / 2, store, gain)
        return y.pow(2).mean() if labels is not None else y  # last virtual stage: a scalar loss


def hop_ms(ctx, iters: int = 40) -> float:
    """Median milliseconds of one awaited message: rank 2i+1 is blocked in its recv while rank 2i sleeps 5 ms,
    then sends one activation (batch_isend_irecv, as the executor posts it); from the send being posted to the
    recv returning, on the one host clock, so the blocked process's wake-up is included."""
    sender, stamps = ctx.rank % 2 == 0, []
    op = dist.P2POp(dist.isend if sender else dist.irecv, torch.zeros(ACT_SHAPE), ctx.rank ^ 1)
    for _ in range(iters):
        dist.barrier()
        if sender:
            time.sleep(0.005)
        t0 = time.perf_counter()
        for request in dist.batch_isend_irecv([op]):
            request.wait()
        stamps.append(t0 if sender else time.perf_counter())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stamps)
    return (
        statistics.median(
            done - posted for r in range(0, len(everyone), 2) for posted, done in zip(everyone[r], everyone[r + 1])
        )
        * 1e3
    )


def run_case(ctx, schedule: str, vpp: int, m: int, f_s: float, steps: int) -> dict | None:
    """Warm-up + `steps` executed steps of one schedule; on rank 0 the median step against the simulator."""
    from megatron_lite.pipeline.executor import PipelineExecutor
    from megatron_lite.pipeline.partition import rank_chunks

    f_chunk, b_chunk = f_s / vpp, 2 * f_s / vpp
    model = StandIn(vpp, ACT_SHAPE[2], f_chunk, b_chunk)
    chunks = rank_chunks(ctx.pp_rank, PP, vpp, PP * vpp, v_shape=v_shaped(schedule))
    executor = PipelineExecutor(
        chunks, schedule, PP, ctx.pp_rank, ACT_SHAPE, torch.float32, ctx.device, ctx.pp_global_rank, ctx.pp_group
    )
    executor.record_timeline = True
    batches = [torch.randint(0, 100, (ACT_SHAPE[0], ACT_SHAPE[1] + 1)) for _ in range(m)]  # (b, s+1) tokens
    runs = []
    for step in range(1 + steps):  # step 0 warms up
        dist.barrier()
        after_barrier = time.perf_counter()
        stats = executor.run(model, batches)
        model.zero_grad(set_to_none=True)
        gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
        dist.gather_object((after_barrier, stats.timeline, stats.wait_s), gathered, dst=0)
        if ctx.rank == 0 and step > 0:
            t0 = min(e[0] for _, tl, _ in gathered for e in tl)
            runs.append(
                {
                    "makespan": max(e[1] for _, tl, _ in gathered for e in tl) - t0,
                    "busy": max(sum(e[1] - e[0] for e in tl) for _, tl, _ in gathered),
                    "spread": max(g[0] for g in gathered) - min(g[0] for g in gathered),
                    "timelines": [[(e[0] - t0, e[1] - t0, *e[2:]) for e in tl] for _, tl, _ in gathered],
                    "wait_s": [w for _, _, w in gathered],
                }
            )
    if ctx.rank != 0:
        return None
    ideal = m * vpp * (f_chunk + b_chunk)
    plan = build_schedule(schedule, PP, vpp, m)
    sim = simulate(plan, PP, vpp, m, f_chunk, b_chunk, name=schedule)  # W costs half the backward
    n_comms = max(sum(isinstance(step, Comm) for step in rank_steps) for rank_steps in plan)
    runs.sort(key=lambda r: r["makespan"])
    med = runs[len(runs) // 2]
    kinds = {e[2] for tl in med["timelines"] for e in tl}
    mean = {k: statistics.mean(e[1] - e[0] for tl in med["timelines"] for e in tl if e[2] == k) for k in kinds}
    backward = mean["B"] + mean.get("W", 0.0)
    at_measured_costs = simulate(
        plan, PP, vpp, m, mean["F"], backward, w_cost=mean.get("W"), v_shape=v_shaped(schedule)
    ).makespan  # messages still free
    peaks = [0] * PP
    for rank, tl in enumerate(med["timelines"]):  # forwards whose W (B without W's) has not run
        held = 0
        for e in tl:
            held += 1 if e[2] == "F" else -1 if e[2] == ("W" if "W" in kinds else "B") else 0
            peaks[rank] = max(peaks[rank], held)
    return {
        "schedule": schedule,
        "vpp": vpp,
        "m": m,
        "f_chunk_ms": f_chunk * 1e3,
        "b_chunk_ms": b_chunk * 1e3,
        "theory": sim.bubble,
        "formula": expected_bubble(schedule, PP, vpp, m, f_chunk, b_chunk),
        "peak_in_flight_sim": sim.peak_in_flight,
        "peak_held_sim": sim.peak_held,
        "peak_held_measured": peaks,
        "measured": (med["makespan"] - ideal) / ideal,
        "busy": (med["makespan"] - med["busy"]) / med["busy"],
        "measured_all_steps": [(r["makespan"] - ideal) / ideal for r in runs],
        "ratio": (med["makespan"] - ideal) / ideal / sim.bubble,
        "makespan_ms": med["makespan"] * 1e3,
        "ideal_ms": ideal * 1e3,
        "theory_makespan_ms": sim.makespan * 1e3,
        "comm_steps_per_rank": n_comms,
        "extra_ms_per_comm": (med["makespan"] - at_measured_costs) * 1e3 / n_comms,
        "mean_f_ms": mean["F"] * 1e3,
        "mean_b_ms": mean["B"] * 1e3,
        "mean_w_ms": mean.get("W", 0.0) * 1e3,
        "wait_ms_per_rank": [round(w * 1e3, 1) for w in med["wait_s"]],
        "barrier_exit_spread_ms": med["spread"] * 1e3,
        "timelines": med["timelines"],
        "sim_timelines": [[(e.start, e.end, e.kind, e.microbatch, e.chunk) for e in tl] for tl in sim.timelines],
    }


class CallCounter(CommCounter):
    """CommCounter that also counts calls, files both under `phase`, and wraps dist.reduce as well."""

    def __init__(self, groups: dict):
        self.calls, self.phase = defaultdict(int), "setup"
        super().__init__(groups)
        dist.reduce = self._wrap(dist.reduce, "reduce", 0, 3, lambda n: 1.0)  # reduce(tensor, dst, op, group)

    def _group_name(self, group) -> str:
        return f"{super()._group_name(group)}/{self.phase}"

    def _wrap(self, fn, kind, idx, group_idx, factor):
        counted = super()._wrap(fn, kind, idx, group_idx, factor)

        def wrapped(*args, **kwargs):
            group = args[group_idx] if len(args) > group_idx else kwargs.get("group")
            if self.active and dist.get_world_size(group) > 1:
                self.calls[(self._group_name(group), kind)] += 1
            return counted(*args, **kwargs)

        return wrapped


def measure_zero(stage: int, counter: CallCounter, m: int = 4) -> dict:
    """One pp=2 x dp=2 training step with zero.stage=stage, collectives counted by group and phase."""
    from megatron_lite.cli import load
    from megatron_lite.data.sampler import MicroBatches, open_streams
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.kernels import resolve_backend
    from megatron_lite.layout import Layout
    from megatron_lite.model.gpt import GPT
    from megatron_lite.model.parallelize import parallelize
    from megatron_lite.model.tied import tie_across_stages
    from megatron_lite.parallel.context import ParallelContext
    from megatron_lite.pipeline.partition import rank_chunks

    micro = 2
    cfg = load(
        [
            "train.precision=fp32",
            "logging.wandb.mode=disabled",
            "checkpoint.resume=never",
            "parallel.pp=2",
            f"zero.stage={stage}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * 2 * m}",
        ]
    )
    ctx = ParallelContext.build(1, 2)
    counter.groups = {name: dist.get_process_group_ranks(g) for name, g in (("dp", ctx.dp_group), ("pp", ctx.pp_group))}
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model, tp=1).keep_chunks(rank_chunks(ctx.pp_rank, 2, 1, cfg.model.n_layers))
    model = parallelize(model, ctx.tp_group, False)  # as build_model does; a no-op at tp=1
    tie_across_stages(model, ctx.embed_group, ctx.pp_rank, ctx.pp_size)
    model.set_kernels(resolve_backend(cfg.kernels.backend, ctx.device))
    n_params = sum(p.numel() for p in model.parameters())
    layout = Layout.of_run(cfg, ctx.world_size)
    engine = Engine(model, ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
    plain_step = engine.ds_engine.step

    def step(*args, **kwargs):  # everything the optimizer step sends is filed under "step"
        counter.phase = "step"
        return plain_step(*args, **kwargs)

    engine.ds_engine.step = step
    stream = open_streams(cfg.data.path, cfg.data.weights, cfg.model.seq_len, cfg.seed, validation=False).train
    batches = MicroBatches(stream, cfg.train.global_batch_size, micro, ctx.dp_rank, ctx.dp_size)
    engine.train_step(batches.next_step(), 1e-3, 1)  # warm-up
    counter.bytes.clear()
    counter.calls.clear()
    counter.phase, counter.active = "schedule", True
    engine.train_step(batches.next_step(), 1e-3, 2)
    counter.active = False
    engine.close()
    return {
        "rank": ctx.rank,
        "pp_rank": ctx.pp_rank,
        "params": n_params,
        "bus_bytes": {f"{g} {k}": round(v) for (g, k), v in sorted(counter.bytes.items())},
        "calls": {f"{g} {k}": c for (g, k), c in sorted(counter.calls.items())},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON record; PNGs go next to it (default bench/results)")
    ap.add_argument("--f-ms", type=float, default=20.0, help="forward of one rank's share of the model (ms)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per case, after one warm-up")
    ap.add_argument("--schedules", nargs="+", default=None, help="only these schedules (default: every case)")
    ap.add_argument("--no-zero", action="store_true", help="skip the ZeRO-1 vs ZeRO-2 collective counts")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS), help="micro-batches per step (default 4 8 16)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:  # relaunch under torchrun
        from megatron_lite.parallel.context import free_port, torchrun_env

        # Remove only this run's leftovers (tests/distributed/launcher.py clears every run's, which would pull
        # them from under other jobs on a shared machine): torchrun's scratch dirs go to a private TMPDIR,
        # and DeepSpeed names its CPU all-reduce buffers /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>.
        port, scratch = free_port(), tempfile.mkdtemp(prefix="bench_pipeline_")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={PP}",
            f"--master-port={port}",
            __file__,
            *(argv or sys.argv[1:]),
        ]
        env = torchrun_env(ROOT, TMPDIR=scratch)
        try:
            code = subprocess.call(cmd, env=env, cwd=ROOT)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
                os.remove(path)
        sys.exit(code)

    from megatron_lite.parallel.context import ParallelContext, init_distributed

    init_distributed()
    ctx = ParallelContext.build(1, PP)
    hop = hop_ms(ctx)
    cases = [(s, vpp) for s, vpp in CASES if args.schedules is None or s in args.schedules]
    rows = [run_case(ctx, schedule, vpp, m, args.f_ms / 1e3, args.steps) for m in args.ms for schedule, vpp in cases]
    counter, zero = CallCounter({}), {}
    for stage in () if args.no_zero else (1, 2):
        per_rank = [None] * dist.get_world_size() if ctx.rank == 0 else None
        dist.gather_object(measure_zero(stage, counter), per_rank, dst=0)
        zero[f"zero.stage={stage}"] = per_rank
    if ctx.rank == 0:
        print(
            f"pp={PP}, F={args.f_ms:g} ms per rank-share (B=2F), median of {args.steps} steps; one message hop "
            f"takes {hop:.2f} ms when the receiver is already waiting"
        )
        print(
            f"{'schedule':<12}{'vpp':>4}{'m':>4}{'theory':>9}{'measured':>10}{'ratio':>7}{'busy':>8}"
            f"{'makespan ms':>13}{'ideal ms':>10}{'F ms':>7}{'B ms':>7}{'W ms':>7}{'extra ms/Comm':>15}"
            "  peak held per rank"
        )
        for r in rows:
            print(
                f"{r['schedule']:<12}{r['vpp']:>4}{r['m']:>4}{r['theory']:>9.3f}{r['measured']:>10.3f}"
                f"{r['ratio']:>7.2f}{r['busy']:>8.3f}{r['makespan_ms']:>13.1f}{r['ideal_ms']:>10.1f}"
                f"{r['mean_f_ms']:>7.2f}{r['mean_b_ms']:>7.2f}{r['mean_w_ms']:>7.2f}{r['extra_ms_per_comm']:>15.2f}"
                f"  {r['peak_held_measured']}"
            )
        if zero:  # (not measured with --no-zero)
            print(
                "DP-group collectives of one pp=2 x dp=2 step, m=4, per rank: bus bytes (calls) during the schedule "
                "| during step()"
            )
        for stage, per_rank in zero.items():  # empty with --no-zero
            for r in per_rank:
                cells = [
                    [
                        sum(v for k, v in r[what].items() if k.startswith(f"dp/{phase} "))
                        for what in ("bus_bytes", "calls")
                    ]
                    for phase in ("schedule", "step")
                ]
                print(
                    f"{stage} rank {r['rank']} (pp_rank {r['pp_rank']}, {r['params']:,} params): "
                    + " | ".join(f"{b:,} ({c})" for b, c in cells)
                )
        out_dir = os.path.dirname(args.out) if args.out else os.path.join(ROOT, "bench", "results")
        os.makedirs(out_dir, exist_ok=True)
        for r in rows:
            if r["m"] == PLOT_M:
                name = r["schedule"] + (f"_vpp{r['vpp']}" if r["vpp"] > 1 else "")
                plot_timeline(r, os.path.join(out_dir, f"pipeline_timeline_pp{PP}_m{PLOT_M}_{name}.png"), PP)
        if args.out:
            from tools.commit import git_commit

            dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout)
            record = {
                "bench": "pipeline",
                "date": datetime.date.today().isoformat(),
                "commit": git_commit(),
                "uncommitted_changes": dirty,
                "device": f"CPU ({os.cpu_count()} cores), gloo, {PP} ranks",
                "pp": PP,
                "f_ms": args.f_ms,
                "b_over_f": 2,
                "act_shape": ACT_SHAPE,
                "measured_steps": args.steps,
                "awaited_hop_ms": hop,
                "rows": [{k: v for k, v in r.items() if not k.endswith("timelines")} for r in rows],
                "timelines_m8": {f"{r['schedule']}_vpp{r['vpp']}": r["timelines"] for r in rows if r["m"] == PLOT_M},
                "zero_pp2_dp2_m4": zero,
            }
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
