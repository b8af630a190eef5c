"""One command measures a GPU: tests, kernels, and bf16 training throughput / MFU / memory against baselines.

    python tools/bench_gpu.py                 # or: make bench-gpu   (at most --budget-s, 570 s by default)
    python tools/bench_gpu.py --quick         # smaller shapes and fewer steps, to check the tool

In one run, on the first CUDA device, with nothing fetched from the network:
1. the device's ceilings, measured: device-to-device copy bandwidth, a bf16 8192^3 matmul and, on a GPU with
   float8 (compute capability 8.9+), the same matmul in e4m3 through torch._scaled_mm;
2. `tests/gpu` and the CUDA cases of the kernel unit tests (pytest, pass/fail counts);
3. `tools/bench_kernels.py` (every fused kernel against torch eager and torch.compile);
4. training throughput, bf16, one GPU, for gpt2-124m (b 8, s 1024) and gpt-1.3b (b 4, s 2048), each side by
   side in the same run (every case in a fresh process, timed after warm-up, median of the timed steps):
   - ours: the trainer's model and DeepSpeed engine as `train.py` builds them (zero.stage=0 by default: fp32
     weights under bf16 autocast, as the baselines): ours-auto as configured by default (kernels.backend=auto),
     ours-torch and ours-triton with every op on one backend, ours-compile with train.compile=true, ours-zero1
     with zero.stage=1, where DeepSpeed holds bf16 weights (fp32 master copy and gradient accumulation) and
     the whole step runs in bf16 with no per-step weight casts, and ours-zero1-compile; ours-fp8 and
     ours-fp8-compile with train.fp8=rowwise (torchao's float8 matmuls in the blocks' projections; MFU still
     over the bf16 peak, as torchtitan counts it), and with `--models llama-3b --sides` FP8_SIDES, float8
     against bf16 on a Llama-3.2-3B shape (b 2, s 2048: 55 GiB predicted on an H100), eager and compiled;
   - hf: transformers' GPT2LMHeadModel, SDPA attention, fp32 weights under bf16 autocast, torch AdamW (fused);
   - compiled: a minimal nanoGPT-style GPT of the same shape, tools/gpu_baselines.py (SDPA, fp32 weights, bf16
     autocast, fused AdamW), torch.compile'd: the loop users compare with;
   - ours-compile-global16 and compiled-global16: the same, 16 sequences a step (gradients accumulated over
     micro-batches of the shape above, one optimizer step), as a real run's global batch amortizes AdamW;
   tokens/s, TFLOP/s and MFU (model FLOPs of megatron_lite.metrics.flops over the datasheet bf16 peak), and the peak
   allocated memory (torch.cuda.max_memory_allocated over the timed steps, optimizer states included);
5. `tools/tune_norm_kernels.py`: the norms' launch shapes swept (kernels/row_tiles.py), best against default;
6. `tools/bench_documents.py` in bf16: data.document_mask's variable-length attention and training step against
   causal ones at seq 1024, documents of 128 tokens.
The run keeps to a wall-clock budget (`--budget-s`, 570 s: a GPU lease runs one command for at most 10 minutes):
each part gets what is left of it, and what would start with too little left is listed as not reached. Hence
the order: gpt-1.3b (the MFU target) before gpt2-124m, and within a model the default side and both baselines
first. On one H100 the default run without the tuning measured about 620 s (tests 73 s; the ceilings, the kernels
and gpt-1.3b's eight sides 362 s; gpt2-124m's eight about 180 s), so gpt2-124m's last sides gave way first. Of a
case's roughly 24 s there, about 17 s were neither warm-up nor timed steps: the process's start-up, its model
and optimizer. So each case's process now starts one case ahead (CaseProcess): its imports and CUDA start-up
overlap the case before it, whose timed steps wait until they are done. Each case records its start-up
(`imports_s`, hidden this way), set-up (`setup_s`: config, model, optimizer) and warm-up (`warmup_s`).
Results: bench/results/gpu_<device>.json and .md, with device, date and commit. Without CUDA it says so in one
line and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.case_process import CaseProcess  # noqa: E402
from tools.commit import git_commit  # noqa: E402
from tools.gpu_baselines import compiled_step, hf_step  # noqa: E402
from tools.gpu_report import markdown  # noqa: E402
from tools.gpu_subruns import run_pytest, run_tool  # noqa: E402

MODELS = {  # preset: (micro-batch, sequence length), the shapes issue 24 names; gpt-1.3b, the MFU target, first
    "gpt-1.3b": (4, 2048),
    "gpt2-124m": (8, 1024),
    "llama-3b": (2, 2048),  # float8's larger model (issue 55): run with --models llama-3b --sides FP8_SIDES
}
DEFAULT_MODELS = ("gpt-1.3b", "gpt2-124m")
# ours-<parts>: auto (the default), torch or triton kernels, compile (train.compile=true), zero1 (zero.stage=1), in
# any combination; ours-auto is the trainer as `train.py` runs it by default. The baselines come right after it,
# so that a run cut short by its time budget still has every ratio of what it measured. Not run by default:
# accum<m> and recast (side_overrides), e.g. --sides ours-accum4,ours-accum4-recast, and global<n> on any side
# (global_batch), e.g. --sides ours-compile-global16,compiled-global16.
SIDES = (
    "ours-auto",
    "hf",
    "compiled",
    "ours-compile",
    "ours-compile-global16",
    "compiled-global16",
    "ours-torch",
    "ours-triton",
    "ours-zero1",
    "ours-zero1-compile",
    "ours-fp8",
    "ours-fp8-compile",
)
# train.fp8 against bf16, eager and compiled, for the larger model: `--models llama-3b --sides` these.
FP8_SIDES = ("ours-auto", "ours-fp8", "ours-compile", "ours-fp8-compile", "ours-fp8tensorwise-compile")
BUDGET_S = 570  # one run's default wall-clock budget: within 10 minutes (a GPU lease's limit per command)
MIN_CASE_S = 30  # a throughput case is not started with less than this left (start-up and warm-up alone)


# ---------------------------------------------------------------------------------------------------------
# One case, in its own process.


def _model_cfg(preset: str, seq: int):
    from omegaconf import OmegaConf

    from megatron_lite.cli import compose_config

    return OmegaConf.to_object(compose_config([f"model={preset}", f"model.seq_len={seq}", "model.dropout=0.0"])).model


def global_batch(side: str, micro: int) -> int:
    """Sequences a step of `side` trains: `micro` (the model's shape), or n for a global<n> part, which
    accumulates gradients over n / micro micro-batches of the model's shape before one optimizer step (any side,
    the baselines too): how a real run amortizes the optimizer step and the clip over a global batch."""
    n = [int(p[6:]) for p in side.split("-")[1:] if p.startswith("global") and p[6:].isdigit()]
    assert len(n) <= 1 and (not n or n[0] % micro == 0), f"{side}: {n} sequences are not whole micro-batches of {micro}"
    return n[0] if n else micro


def side_overrides(preset: str, micro: int, seq: int, side: str) -> tuple[list[str], bool]:
    """The config of an ours-<parts> side, and whether it recasts. Parts beyond the kernels, compile and zero1:
    accum<m> runs the same tokens a step as m micro-batches of micro/m (gradient accumulation); recast takes
    back one_copy_per_step, so every micro-batch casts the weights to bf16 again (autocast's own cache, as before
    0b63767): the baseline that accum<m> is compared with; global<n> (global_batch) trains n sequences a step."""
    glob = global_batch(side, micro)
    parts = {p for p in side.split("-")[1:] if not (p.startswith("global") and p[6:].isdigit())}
    accum = [p for p in parts if p.startswith("accum") and p[5:].isdigit()]
    known = {"auto", "torch", "triton", "compile", "zero1", "recast", "fp8", "fp8tensorwise"}
    assert parts - set(accum) <= known, f"unknown side {side}"
    m = int(accum[0][5:]) if accum else 1
    assert len(accum) <= 1 and micro % m == 0, f"{side}: {micro} sequences do not split into {m} micro-batches"
    backend = "triton" if "triton" in parts else "torch" if "torch" in parts else "auto"
    return [
        f"model={preset}",
        f"model.seq_len={seq}",
        "model.dropout=0.0",
        f"train.micro_batch_size={micro // m}",
        f"train.global_batch_size={glob}",
        "train.precision=bf16",
        "logging.wandb.mode=disabled",
        f"kernels.backend={backend}",
        f"train.compile={'true' if 'compile' in parts else 'false'}",
        f"zero.stage={1 if 'zero1' in parts else 0}",
        f"train.fp8={'rowwise' if 'fp8' in parts else 'tensorwise' if 'fp8tensorwise' in parts else 'none'}",
    ], "recast" in parts


def _ours(preset: str, micro: int, seq: int, side: str):
    import contextlib

    from omegaconf import OmegaConf

    from megatron_lite.cli import compose_config
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.kernels import resolve_backend
    from megatron_lite.layout import Layout
    from megatron_lite.model.build import build_model
    from megatron_lite.parallel.context import ParallelContext, init_distributed

    overrides, recast = side_overrides(preset, micro, seq, side)
    cfg = OmegaConf.to_object(compose_config(overrides))
    init_distributed()
    ctx = ParallelContext.build()
    layout = Layout.of_run(cfg, ctx.world_size)
    model = build_model(cfg, ctx, layout)
    model.set_kernels(resolve_backend(cfg.kernels.backend, ctx.device))
    model.set_fp8(cfg.train.fp8, ctx.device.type)
    if cfg.train.compile:
        model.compile_blocks()
    engine = Engine(model, ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
    if recast:
        engine._weight_copies = contextlib.nullcontext
    t = cfg.train
    batches = [
        torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, seq + 1), device=ctx.device)
        for _ in range(t.global_batch_size // t.micro_batch_size)
    ]
    return cfg.model, lambda: engine.train_step(batches, cfg.optim.lr, 1)


def device_seconds(events) -> float:
    """GPU time of the kernels, copies and memsets among torch.profiler's averaged events. An op's row repeats
    the device time of the kernels it launched, and so does a user annotation's GPU range
    (Optimizer.step#AdamW.step spans the fused AdamW kernels): neither is counted."""
    return (
        sum(
            e.self_device_time_total
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        / 1e6
    )


def profile(step, path: str, steps: int = 3) -> None:
    """torch.profiler over a few steps: the kernels by GPU time, and the host-side ops by CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    gpu = device_seconds(events) / steps
    with open(path, "w") as f:
        f.write(f"per step: wall {1e3 * wall:.1f} ms, GPU kernels {1e3 * gpu:.1f} ms ({100 * gpu / wall:.0f}% busy)\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
        f.write("\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def run_case(
    preset: str,
    micro: int,
    seq: int,
    side: str,
    warmup: int,
    steps: int,
    profile_dir: str | None = None,
    before_timing=lambda: None,
) -> dict:
    from megatron_lite.metrics.flops import model_flops_per_token, peak_flops

    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    predicted = None
    if side.startswith("ours"):
        model_cfg, step = _ours(preset, micro, seq, side)
        from megatron_lite.plan.measured import predict_run

        predicted = predict_run(side_overrides(preset, micro, seq, side)[0])  # cluster.gpu=auto: this GPU
    else:
        base, accumulate = side.split("-")[0], global_batch(side, micro) // micro
        known = base in ("hf", "compiled") and side in (base, f"{base}-global{micro * accumulate}")
        assert known, f"unknown side {side}"
        model_cfg = _model_cfg(preset, seq)
        step = (hf_step if base == "hf" else compiled_step)(model_cfg, micro, seq, accumulate)
    t0 = time.perf_counter()
    setup_s = t0 - t_start  # config, model, optimizer
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    before_timing()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    if profile_dir:
        profile(step, os.path.join(profile_dir, f"prof_{preset}_{side}.txt"))
    tokens = global_batch(side, micro) * seq
    peak, source = peak_flops(torch.device("cuda"), torch.bfloat16)
    tflops = model_flops_per_token(model_cfg, seq) * tokens / step_s
    return {
        "model": preset,
        "side": side,
        "micro_batch": micro,
        "global_batch": global_batch(side, micro),
        "seq_len": seq,
        "step_s": round(step_s, 5),
        "step_s_spread": round((max(times) - min(times)) / step_s, 3),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(tflops / 1e12, 1),
        "mfu": round(tflops / peak, 4),
        "peak_source": source,
        "mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "setup_s": round(setup_s, 1),
        "warmup_s": round(warmup_s, 1),
        "timed_steps": steps,
        # the planner's figures for the same run (plan/measured.py): how far its step time is off on this GPU
        **(
            {
                "predicted_step_s": round(predicted.step.total_s, 5),
                "predicted_error": round(predicted.step.total_s / step_s - 1, 4),
                "predicted_peak_gib": round(predicted.memory_bytes / 2**30, 2),
            }
            if predicted is not None
            else {}
        ),
    }


# ---------------------------------------------------------------------------------------------------------
# The whole run.


def ceilings() -> dict:
    """Measured device-to-device copy bandwidth (read + write), bf16 matmul rate and, where the GPU has float8
    (compute capability 8.9+), torch._scaled_mm's e4m3 rate with one scale per tensor, on random data."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB per buffer
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda").random_(), torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_ms = do_bench(lambda: b.copy_(a), return_mode="median")
    x, y = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = do_bench(lambda: x @ y, return_mode="median")
    out = {"copy_GBps": round(2 * n / copy_ms / 1e6, 1), "matmul_bf16_tflops": round(2 * 8192**3 / mm_ms / 1e9, 1)}
    if torch.cuda.get_device_capability() >= (8, 9):
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major B
        one = torch.ones((), device="cuda")
        fp8_ms = do_bench(lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16), return_mode="median")
        out["matmul_fp8_tflops"] = round(2 * 8192**3 / fp8_ms / 1e9, 1)
    return out


def serve(profile_dir: str | None) -> int:
    """The `--serve` side of CaseProcess: start up, say READY, run the case read from stdin, with its timed steps
    held until the parent says go."""
    t0 = time.perf_counter()
    for name in ("deepspeed", "transformers", "triton", "megatron_lite.engine", "megatron_lite.model.build"):
        importlib.import_module(name)  # the start-up every side pays, done ahead of the case's turn
    torch.cuda.init()
    imports_s = time.perf_counter() - t0
    print("READY", flush=True)
    spec = sys.stdin.readline().strip()
    if not spec:  # closed unused: the run ended before this case's turn
        return 0
    preset, micro, seq, side, warmup, steps = spec.split(",")

    def hold() -> None:
        print("WARM", flush=True)
        sys.stdin.readline()

    result = run_case(preset, int(micro), int(seq), side, int(warmup), int(steps), profile_dir, before_timing=hold)
    print("CASE " + json.dumps({**result, "imports_s": round(imports_s, 1)}), flush=True)
    return 0


def run_side(
    preset: str,
    micro: int,
    seq: int,
    side: str,
    quick: bool,
    profile_dir: str | None,
    timeout: float,
    process: CaseProcess | None = None,
    after: CaseProcess | None = None,
) -> dict:
    """One throughput case in `process` (a fresh one if None; see CaseProcess): its result, or {"error": ...}
    when it failed or outran `timeout` seconds."""
    warmup, steps = (2, 3) if quick else (4 if "compile" in side else 3, 12)
    process = process or CaseProcess(profile_dir)
    line, stderr = process.run(f"{preset},{micro},{seq},{side},{warmup},{steps}", timeout, after)
    if line is not None:
        return json.loads(line[5:])
    return {
        "model": preset,
        "side": side,
        "error": (stderr.strip().splitlines() or ["no output"])[-1],
        "stderr_tail": stderr[-3000:],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="short shapes and few steps (checks the tool)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: tests,kernels,throughput,tune,documents")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--profile", default=None, metavar="DIR", help="also write a torch.profiler table per case")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="wall-clock budget: what would start after it is listed as not reached (default %(default)s)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a CaseProcess
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device on this machine; nothing measured (run it on a GPU node)")
        return 0
    if args.serve:
        return serve(args.profile)

    import triton

    from megatron_lite.metrics.flops import peak_flops

    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.cuda.get_device_name()
    record = {
        "bench": "gpu",
        "device": device,
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "peak_tflops": peak_flops(torch.device("cuda"), torch.bfloat16)[0] / 1e12,
    }
    stem = "gpu_" + device.lower().replace("nvidia ", "").replace(" ", "_") + ("_quick" if args.quick else "")

    def save() -> None:  # after every part, so that a run cut short keeps what it measured
        with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out_dir, stem + ".md"), "w") as f:
            f.write(markdown(record))

    t0 = time.time()
    left = lambda: args.budget_s - (time.time() - t0)  # noqa: E731 - seconds of the run's budget still unspent
    record["budget_s"], record["not_reached"] = args.budget_s, []
    record["ceilings"] = ceilings()
    record["tests"], record["kernels"], record["throughput"] = None, None, []
    print(
        f"bench_gpu: {device}: copy {record['ceilings']['copy_GBps']:,.0f} GB/s, bf16 matmul "
        f"{record['ceilings']['matmul_bf16_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    record["tests"] = (
        {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": [], "exit_code": None}
        if "tests" in skip
        else run_pytest(args.out_dir, args.quick, left())
    )
    save()
    print(
        f"bench_gpu: tests {record['tests']['passed']} passed, {record['tests']['failed']} failed "
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    if "kernels" not in skip:
        record["kernels"] = run_tool("bench_kernels", args.out_dir, args.quick, left())
        save()
    if "throughput" not in skip:
        cases = [(preset, side) for preset in args.models.split(",") for side in args.sides.split(",")]
        after = CaseProcess(args.profile)  # every case's process starts during the case before it
        for i, (preset, side) in enumerate(cases):
            micro, seq = (2, 256) if args.quick else MODELS[preset]
            if left() < MIN_CASE_S:
                record["not_reached"].append(f"{preset} {side}")
                continue
            process, after = after, (CaseProcess(args.profile) if i + 1 < len(cases) else None)
            r = run_side(preset, micro, seq, side, args.quick, args.profile, left(), process, after)
            if "error" in r:
                print(f"bench_gpu: {preset} {side} FAILED: {r['error']}\n{r.pop('stderr_tail')}", flush=True)
            else:
                print(
                    f"bench_gpu: {preset} {side}: {r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.0f} TFLOP/s, "
                    f"MFU {100 * r['mfu']:.1f}%, mem {r['mem_peak_gib']:.1f} GiB; start-up {r['imports_s']:.0f} s "
                    f"(ahead of its turn), set-up {r['setup_s']:.0f} s, warm-up {r['warmup_s']:.0f} s "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
            record["throughput"].append(r)
            save()
        if after is not None:  # started for a case the budget did not reach
            after.close()
    if "tune" not in skip:
        if left() < MIN_CASE_S:
            record["not_reached"].append("tune")
        else:
            record["tune"] = run_tool("tune_norm_kernels", args.out_dir, args.quick, left())
    if "documents" not in skip:
        if left() < MIN_CASE_S:
            record["not_reached"].append("documents")
        else:
            documents = ("--device", "cuda", "--dtype", "bf16", "--batch", "8", "--heads", "16", "--layers", "8")
            record["documents"] = run_tool("bench_documents", args.out_dir, args.quick, left(), documents)
    if record["not_reached"]:
        print(
            f"bench_gpu: not reached within the {args.budget_s:.0f} s budget: {', '.join(record['not_reached'])} "
            "(--budget-s, --sides, --models or --skip)",
            flush=True,
        )
    save()
    print(markdown(record))
    print(f"bench_gpu: done in {time.time() - t0:.0f} s: {args.out_dir}/{stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
