"""tools/bench_gpu.py's record as the markdown page committed beside it in bench/results (gpu_<device>.md)."""

from __future__ import annotations


def markdown(record: dict) -> str:
    c = record["ceilings"]
    lines = [
        f"# GPU measurement: {record['device']}",
        "",
        f"{record['date']}, commit {record['commit']}, torch {record['torch']}, triton {record['triton']}. "
        f"Written by `tools/bench_gpu.py`.",
        "",
        f"Measured ceilings: copy {c['copy_GBps']:,.0f} GB/s (read + write), bf16 matmul 8192^3 "
        f"{c['matmul_bf16_tflops']:.0f} TFLOP/s"
        + (f", float8 (e4m3, _scaled_mm) {c['matmul_fp8_tflops']:.0f} TFLOP/s" if "matmul_fp8_tflops" in c else "")
        + f". MFU uses the datasheet dense bf16 peak ({record['peak_tflops']:.0f} TFLOP/s), float8 sides too.",
        "",
    ]
    t = record["tests"]
    lines += [
        f"Tests (tests/gpu + CUDA cases of the kernel unit tests): {t['passed']} passed, {t['failed']} failed, "
        f"{t['errors']} errors, {t['skipped']} skipped."
        + (" Failing: " + "; ".join(t["failures"]) if t["failures"] else ""),
        "",
    ]
    if record.get("not_reached"):
        lines += [
            f"Not reached within the run's {record['budget_s']:.0f} s budget: {', '.join(record['not_reached'])}.",
            "",
        ]
    lines += [
        "## Training throughput, bf16, one GPU",
        "",
        "| model | b x s | side | step (ms) | tokens/s | TFLOP/s | MFU | mem peak (GiB) | vs hf | vs compiled "
        "| planner: step (ms), error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["throughput"]:
        if "error" in r:
            lines.append(f"| {r['model']} | | {r['side']} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        # against the baselines at the same global batch (a side with global<n> against hf-global<n>, ...)
        glob = r.get("global_batch", r["micro_batch"])
        base = {
            b["side"]: b
            for b in record["throughput"]
            if b["model"] == r["model"] and "error" not in b and b.get("global_batch", b["micro_batch"]) == glob
        }
        suffix = f"-global{glob}" if glob != r["micro_batch"] else ""

        def ratio(side, base=base, suffix=suffix, r=r):
            return f"{r['tokens_per_s'] / base[side + suffix]['tokens_per_s']:.2f}x" if side + suffix in base else "-"

        shape = f"{r['micro_batch']} x {r['seq_len']}" + (f", {glob // r['micro_batch']} a step" if suffix else "")
        lines.append(
            f"| {r['model']} | {shape} | {r['side']} | {1e3 * r['step_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['mem_peak_gib']:.1f} | "
            f"{ratio('hf')} | {ratio('compiled')} | "
            + (
                f"{1e3 * r['predicted_step_s']:.1f}, {100 * r['predicted_error']:+.1f}% |"
                if "predicted_step_s" in r
                else "- |"
            )
        )
    lines += [
        "",
        "Sides: ours-* = our model + DeepSpeed engine (zero.stage=0: fp32 weights under bf16 autocast) with "
        "kernels.backend=auto (the default) unless named: -torch / -triton; -compile = train.compile=true; "
        "-zero1 = zero.stage=1 (bf16 weights, fp32 master weights and gradient accumulation in DeepSpeed); hf = transformers GPT2LMHeadModel (SDPA) with fp32 "
        "weights under bf16 autocast and fused AdamW; compiled = a minimal nanoGPT-style GPT, torch.compile'd, "
        "fp32 weights under bf16 autocast, fused AdamW; -global<n>: n sequences a step, gradients accumulated "
        "over n / b micro-batches of the shape shown before one optimizer step. Median step of the timed steps "
        "after warm-up, each side in a fresh process. Planner: `train.py --check`'s step time for the same run "
        "(plan/measured.py; add the rows to its MEASURED, and the error `--plan` reports on this GPU follows).",
    ]
    k = record.get("kernels")
    if k:
        nan = float("nan")
        lines += [
            "",
            f"## Fused kernels ({k['dtype']}, gpt-1.3b shapes: {k['shape']})",
            "",
            "GPU time: the calls queued behind a GPU sleep, so launch overhead is hidden (an op inside a busy "
            "step). Per call: triton's do_bench, host launch work included where it is longer (a host-bound "
            "step). GB/s and the share of copy bandwidth are the triton kernel's, from GPU time.",
            "",
            "| op | phase | GPU triton (ms) | GPU eager | GPU compile | triton GB/s | of copy bw | vs eager | "
            "vs compile | per call triton (ms) | per call eager | per call vs eager |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in k["rows"]:
            lines.append(
                f"| {r['op']} | {r['phase']} | {r.get('triton_gpu_ms', nan):.3f} | {r.get('eager_gpu_ms', nan):.3f} | "
                f"{r.get('compile_gpu_ms', nan):.3f} | {r.get('gpu_GBps', nan):,.0f} | "
                f"{100 * r.get('gpu_fraction_of_copy_bw', nan):.0f}% | {r.get('gpu_speedup_vs_eager', nan):.2f}x | "
                f"{r.get('gpu_speedup_vs_compile', nan):.2f}x | {r['triton_ms']:.3f} | {r['eager_ms']:.3f} | "
                f"{r['speedup_vs_eager']:.2f}x |"
            )
    tune = record.get("tune")
    if tune:
        default = tuple(tune["default"])
        lines += [
            "",
            f"## Norm kernels' launch shapes ({tune['dtype']}, {tune['rows']} rows; tools/tune_norm_kernels.py)",
            "",
            f"Forward + backward in GPU time. Default: {default[0]} elements a tile, {default[1]} backward programs.",
            "",
            "| op | width | default (ms) | of copy bw | best tile | best bwd programs | best (ms) | of copy bw | gain |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        from tools.tune_norm_kernels import best_against_default

        for op, width, now, best in best_against_default(tune["results"], default):
            lines.append(
                f"| {op} | {width} | {now['fwd+bwd_ms']:.4f} | {100 * now['fwd+bwd_of_copy_bw']:.0f}% | "
                f"{best['tile_elements']} | {best['bwd_programs']} | {best['fwd+bwd_ms']:.4f} | "
                f"{100 * best['fwd+bwd_of_copy_bw']:.0f}% | {now['fwd+bwd_ms'] / best['fwd+bwd_ms']:.2f}x |"
            )
    return "\n".join(lines) + "\n"
