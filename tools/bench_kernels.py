"""Each fused kernel's time and achieved bandwidth against torch eager and torch.compile of its reference.

    python tools/bench_kernels.py --out bench/results/kernels_h100.json     # on a GPU, bf16
    TRITON_INTERPRET=1 python tools/bench_kernels.py --quick                # CPU: checks the tool runs only

For every op, forward and forward + backward are timed for three implementations of the same function:
the Triton kernel, the torch reference run eagerly, and torch.compile of the reference, in two ways:
per call (triton's do_bench: what a caller waits, host launch work included wherever it is longer than the
GPU's) and GPU time (the calls queued behind a GPU sleep so that the host is ahead, as in a step of a large
model; `gpu_timer`). Achieved GB/s is the op's minimum memory traffic (every input read once, every output
written once; for backward also the incoming gradient read and the input gradients written) divided by the
time, and it is compared with the device's measured copy bandwidth (a large device-to-device copy: read +
write). Targets (issue #4): memory-bound kernels >= 80% of copy bandwidth and >= 1.5x torch eager.

On CPU the Triton interpreter runs the kernels in numpy: the timings say nothing about kernel speed, so
the tool runs tiny shapes once to show that every path works and writes no result file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.kernels import cross_entropy, gelu, layernorm, rmsnorm, rope, swiglu  # noqa: E402
from tools.commit import git_commit  # noqa: E402


def cases(tokens: int, hidden: int, ffn: int, heads: int, vocab: int, dtype, device):
    """(name, triton fn, reference fn, inputs, bytes forward, bytes forward+backward) at a GPT shape."""

    def t(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(grad)

    e = torch.finfo(dtype).bits // 8
    hd, s = hidden // heads, 2048 if tokens >= 2048 else tokens
    b = tokens // s
    x, w, bias = t(tokens, hidden), t(hidden), t(hidden)
    q = t(b, s, heads, hd).transpose(1, 2)  # the model's (b, heads, s, hd) view (a non-leaf: grad flows to the base)
    angles = torch.randn(s, hd // 2, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    h_up, h_ffn, b_ffn = t(tokens, 2 * ffn), t(tokens, ffn), t(ffn)
    logits, labels = t(tokens, vocab), torch.randint(0, vocab, (tokens,), device=device)
    n = tokens * hidden
    yield "rmsnorm", rmsnorm.rms_norm_triton, rmsnorm.rms_norm_reference, (x, w, 1e-5), 2 * n * e, 5 * n * e
    yield (
        "layernorm",
        layernorm.layer_norm_triton,
        layernorm.layer_norm_reference,
        (x, w, bias, 1e-5),
        2 * n * e,
        5 * n * e,
    )
    yield "rope", rope.apply_rope_triton, rope.apply_rope_reference, (q, cos, sin), 2 * n * e, 4 * n * e
    m = tokens * ffn
    yield "swiglu", swiglu.swiglu_triton, swiglu.swiglu_reference, (h_up,), 3 * m * e, 8 * m * e
    yield "bias_gelu", gelu.bias_gelu_triton, gelu.bias_gelu_reference, (h_ffn, b_ffn), 2 * m * e, 5 * m * e
    v = tokens * vocab
    # The kernel's backward writes the gradient over its logits, so repeated calls see changed (finite)
    # values; the traffic, and so the timing, is the same.
    yield (
        "cross_entropy",
        cross_entropy.cross_entropy_triton,
        cross_entropy.cross_entropy_reference,
        (logits, labels),
        v * e,
        3 * v * e,
    )


def timer(device):
    """Seconds per call as a caller sees it: the median of triton's do_bench, which includes the host's launch
    work whenever that is longer than the GPU's (small ops). On CPU one timed call after a warm one."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100) / 1e3  # seconds (median)

    def once(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def gpu_timer(calls: int = 20, repeats: int = 3):
    """Seconds of GPU time per call, the host kept ahead: the calls are queued behind a GPU sleep long enough
    for the host to enqueue all of them, so no launch overhead shows; each call follows an L2 flush (a 256 MiB
    fill), whose time is measured the same way and subtracted. This is what an op costs inside a step that
    keeps the GPU busy (a large model); `timer` is what it costs when the host is the bottleneck.

    Each timing checks that the host really was ahead: when the last call is queued, the GPU must still be
    asleep. If it has woken (the sleep was too short: the host slower than one warm call suggested, or the
    clock faster than when the sleep was calibrated), the GPU idled between calls, so the timing is dropped and
    taken again with twice the sleep."""
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    torch.cuda.synchronize()
    cycles_per_s = 10**7 / (start.elapsed_time(end) / 1e3)

    def queued(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        host = time.perf_counter() - t0  # an upper bound of one call's enqueueing
        sleep_s = min(0.5, 2 * calls * (host + 50e-6))
        times = []
        while len(times) < repeats:
            torch.cuda._sleep(int(cycles_per_s * sleep_s))
            start.record()
            for _ in range(calls):
                flush.zero_()
                fn()
            ahead = not start.query()  # the GPU has not reached the first call yet: all were queued before it ran
            end.record()
            torch.cuda.synchronize()
            if ahead or sleep_s > 1:  # an op that waits for the GPU itself can never be ahead
                times.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                sleep_s *= 2
        return sorted(times)[len(times) // 2]

    flush_s = queued(lambda: None)
    return lambda fn: max(queued(fn) - flush_s, 0.0)


def kernel_device(tool: str, quick: bool) -> tuple[torch.device, bool]:
    """The device a kernel tool measures on and whether to run its quick shapes: a GPU, or on CPU only Triton's
    interpreter, where the shapes are always the quick ones."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"{tool}: no GPU; set TRITON_INTERPRET=1 and pass --quick to check the tool on CPU")
    return device, quick or device.type == "cpu"


def copy_bandwidth(device, measure) -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / measure(lambda: dst.copy_(src))


def run_case(fn, inputs, backward: bool):
    tensors = [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad]
    if not backward:

        def step():
            with torch.no_grad():
                fn(*inputs)

        return step

    incoming = []  # the gradient handed to backward, made once: filling it is not the op's work

    def step():
        out = fn(*inputs)
        if not incoming:
            incoming.append(torch.ones_like(out))
        # The gradients are returned, not accumulated into .grad: in a model the op's inputs are activations,
        # and a leaf's AccumulateGrad adds passes that are not the op's. Up to f4f137b it cloned cross entropy's
        # gradient (the kernel writes it over the logits, so it aliases its input) and added rope's into the
        # base of its transposed view (.grad = None on the view did not clear the base's). At copy bandwidth
        # those passes take about 0.55 of the 1.44 ms cross entropy measured forward + backward on an H100, and
        # 0.034 of rope's 0.085 ms.
        torch.autograd.grad(out, tensors, incoming[0])

    return step


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter: checks the paths)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it needs a C compiler)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, quick = kernel_device("bench_kernels", args.quick)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = (
        dict(tokens=64, hidden=96, ffn=160, heads=4, vocab=1000)
        if quick
        else dict(tokens=8192, hidden=2048, ffn=8192, heads=16, vocab=50304)
    )  # gpt-1.3b, 4 x 2048 tokens
    measure = timer(device)
    measure_gpu = gpu_timer() if device.type == "cuda" else None
    bandwidth = copy_bandwidth(device, measure) if not quick else float("nan")
    rows = []
    for name, fused, reference, inputs, bytes_fwd, bytes_all in cases(**shape, dtype=dtype, device=device):
        impls = {"triton": fused, "eager": reference}
        if not args.no_compile:
            impls["compile"] = torch.compile(reference, dynamic=False)
        for phase, nbytes, backward in (("fwd", bytes_fwd, False), ("fwd+bwd", bytes_all, True)):
            times = {k: measure(run_case(fn, inputs, backward)) for k, fn in impls.items()}
            row = {
                "op": name,
                "phase": phase,
                "bytes": nbytes,
                **{f"{k}_ms": 1e3 * v for k, v in times.items()},
                "triton_GBps": nbytes / times["triton"] / 1e9,
                "speedup_vs_eager": times["eager"] / times["triton"],
            }
            if "compile" in times:
                row["speedup_vs_compile"] = times["compile"] / times["triton"]
            row["fraction_of_copy_bw"] = nbytes / times["triton"] / bandwidth
            line = "  ".join(f"{k} {1e3 * v:8.3f} ms" for k, v in times.items())
            if measure_gpu is not None:  # the same, in GPU time (launch overhead hidden)
                gpu = {k: measure_gpu(run_case(fn, inputs, backward)) for k, fn in impls.items()}
                row.update({f"{k}_gpu_ms": 1e3 * v for k, v in gpu.items()})
                row.update(
                    gpu_GBps=nbytes / gpu["triton"] / 1e9,
                    gpu_fraction_of_copy_bw=nbytes / gpu["triton"] / bandwidth,
                    gpu_speedup_vs_eager=gpu["eager"] / gpu["triton"],
                )
                if "compile" in gpu:
                    row["gpu_speedup_vs_compile"] = gpu["compile"] / gpu["triton"]
                line += (
                    "  | GPU "
                    + "  ".join(f"{k} {1e3 * v:7.3f}" for k, v in gpu.items())
                    + f" ms, triton {100 * row['gpu_fraction_of_copy_bw']:.0f}% of copy"
                )
            rows.append(row)
            share = (
                ""
                if device.type == "cpu"
                else f"  per call: triton {row['triton_GBps']:7.1f} GB/s ({100 * row['fraction_of_copy_bw']:.0f}% of copy)"
            )
            print(f"{name:<14}{phase:<9}" + line + share + f"  x{row['speedup_vs_eager']:.2f} vs eager", flush=True)
    if device.type == "cpu":
        print("CPU interpreter: every path ran; the timings are not kernel speed (no result written)")
        return rows
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "bench": "kernels",
                    "device": torch.cuda.get_device_name(),
                    "dtype": args.dtype,
                    "shape": shape,
                    "copy_GBps": bandwidth / 1e9,
                    "rows": rows,
                    "commit": git_commit(),
                    "date": datetime.date.today().isoformat(),
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
