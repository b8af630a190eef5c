"""What `train.py --check` and `--plan` print and write: one line, a ranked table, JSON rows."""

from __future__ import annotations

import json

from megatron_lite.plan import Prediction
from megatron_lite.plan.hardware import Cluster

GIB = 2**30


def layout_text(p: Prediction) -> str:
    lay = p.layout
    parts = [
        f"dp {lay.dp}",
        f"tp {lay.tp}{' +sp' if lay.sp else ''}",
        f"cp {lay.cp}{f' {lay.cp_mode}' if lay.cp > 1 else ''}",
        f"pp {lay.pp}",
        f"vpp {lay.vpp}",
        lay.schedule if lay.pp > 1 else "no pipeline",
        f"zero {lay.zero_stage}"
        + (f" in groups of {lay.shard_size} dp ranks, {lay.replicas} replicas" if lay.replicas > 1 else "")
        + (f" hpz {lay.hpz}" if lay.hpz > 1 else ""),
        f"recompute {lay.recompute}",
        f"micro-batch {lay.micro_batch_size}",
        f"accumulation {lay.accumulation}",
    ]
    if lay.offload_optimizer != "none":
        parts.append(f"optimizer on {lay.offload_optimizer}")
    if lay.offload_param != "none":
        parts.append(f"parameters on {lay.offload_param}")
    if lay.fp8 != "none":
        parts.append(f"fp8 {lay.fp8}")
    return ", ".join(parts)


def _where(p: Prediction) -> str:
    worst = p.worst
    stage = f"pipeline rank {worst.pp_rank}, " if p.layout.pp > 1 else ""
    return f"{stage}at the {worst.phase}"


def check_line(p: Prediction, cluster: Cluster) -> str:
    """`--check` on success: the layout, memory against the GPU's, step time (with the planner's measured error on
    this GPU: plan/measured.py), throughput, MFU."""
    from megatron_lite.plan.measured import multi_gpu_caveat, step_error

    error, measured = step_error(cluster.gpu.name)
    trust = f"its step time off by up to {100 * error:.0f}% on {cluster.gpu.name}" + (
        "" if measured else ", unvalidated"
    )
    caveat = multi_gpu_caveat(cluster.gpu.name) if p.layout.world_size > 1 else ""
    if caveat:
        trust += f"; that error is one GPU's: {caveat}"
    if p.layout.fp8 != "none":  # plan/hardware.FP8_GEMM_ASSUMED
        trust += " in bf16; train.fp8's GEMM rate is assumed, not yet measured"
    return (
        f"layout: {layout_text(p)}; predicted peak {p.memory_bytes / GIB:.1f} GiB per GPU ({_where(p)}) of the "
        f"{p.usable_bytes / GIB:.1f} GiB each {cluster.gpu.name} leaves to tensors; step {p.step.total_s:.3g} s, "
        f"{p.tokens_per_s:,.0f} tokens/s, {p.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {100 * p.mfu:.1f}% "
        f"(predicted, {trust}: docs/planner.md)"
    )


def does_not_fit(p: Prediction, cluster: Cluster, fixes: list[tuple[list[str], Prediction]]) -> str:
    """`--check` when the layout is predicted not to fit: by how much, and the cheapest fix."""
    over = (p.memory_bytes - p.usable_bytes) / GIB
    head = (
        f"the layout ({layout_text(p)}) is predicted to need {p.memory_bytes / GIB:.1f} GiB per GPU "
        f"({_where(p)}), {over:.1f} GiB more than the {p.usable_bytes / GIB:.1f} GiB each {cluster.gpu.name} "
        "leaves to tensors"
    )
    if not fixes:
        return head + (
            "; no change of one or two knobs fits it: run on more GPUs (WORLD_SIZE; `train.py --plan "
            "cluster.nodes=N` ranks the layouts of N nodes)"
        )
    changes, fixed = fixes[0]
    return (
        f"{head}; fastest fix: {' '.join(changes)} ({fixed.memory_bytes / GIB:.1f} GiB, step "
        f"{fixed.step.total_s:.3g} s; `train.py --plan` lists every layout that fits)"
    )


def row(p: Prediction) -> dict:
    lay = p.layout
    return {
        "tp": lay.tp,
        "pp": lay.pp,
        "vpp": lay.vpp,
        "cp": lay.cp,
        "dp": lay.dp,
        "sp": lay.sp,
        "cp_mode": lay.cp_mode,
        "zero_stage": lay.zero_stage,
        "shard_size": lay.shard_size,
        "hpz": lay.hpz,
        "offload_optimizer": lay.offload_optimizer,
        "offload_param": lay.offload_param,
        "recompute": lay.recompute,
        "recompute_every": lay.recompute_every,
        "micro_batch_size": lay.micro_batch_size,
        "accumulation": lay.accumulation,
        "schedule": lay.schedule,
        "memory_gib": round(p.memory_bytes / GIB, 3),
        "step_time_s": p.step.total_s,
        "tokens_per_s": p.tokens_per_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "mfu": p.mfu,
        "fits": p.fits,
        "bubble": p.step.bubble,
        "overrides": " ".join(lay.overrides()),
    }


def write_json(path: str, predictions: list[Prediction], error: float | None = None) -> None:
    """The predictions as JSON rows; with `error` (the planner's measured step-time error on the GPU), each says
    whether it is within that of the fastest that fits."""
    near = near_best(predictions, error) if error is not None else [None] * len(predictions)
    with open(path, "w") as f:
        rows = [
            row(p) if close is None else dict(row(p), within_error_of_best=close) for p, close in zip(predictions, near)
        ]
        json.dump(rows, f, indent=1)


def near_best(predictions: list[Prediction], error: float) -> list[bool]:
    """For each prediction (fastest first), whether it fits and its step time is within `error` (the planner's
    measured step-time error on the GPU: plan/measured.py) of the fastest that fits: the planner cannot tell
    such layouts apart."""
    best = next((p.step.total_s for p in predictions if p.fits), None)
    return [best is not None and p.fits and p.step.total_s <= best * (1 + error) for p in predictions]


def plan_table(predictions: list[Prediction], top: int, cluster: Cluster) -> str:
    """The `--plan` table: the fastest layouts that fit, each with the override line that runs it, those the
    planner cannot tell from the first marked ≈ (its measured error on this GPU: plan/measured.py)."""
    from megatron_lite.plan.measured import multi_gpu_caveat, step_error

    error, measured = step_error(cluster.gpu.name)
    near = near_best(predictions, error)
    fitting = [p for p in predictions if p.fits]
    where = (
        f"{cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu.name} ({cluster.usable_bytes / GIB:.1f} GiB "
        "usable each)"
    )
    lines = [
        f"{len(fitting):,} layouts fit on {where}; the {min(top, len(fitting))} fastest:"
        if fitting
        else f"no layout fits on {where}; the {min(top, len(predictions))} smallest:"
    ]
    header = (
        f"{'#':>3} {'tp':>3} {'sp':>3} {'cp':>3} {'pp':>4} {'vpp':>3} {'dp':>5} {'zero':>4} {'recompute':>9} "
        f"{'micro':>5} {'GiB':>6} {'step s':>8} {'tokens/s':>11} {'TFLOP/s':>7} {'MFU':>6} {'':>2}"
    )
    lines += [header, "-" * len(header)]
    for i, p in enumerate(predictions[:top], 1):
        lay = p.layout
        cp = f"{lay.cp}{'u' if lay.cp > 1 and lay.cp_mode == 'ulysses' else ''}"
        zero = f"{lay.zero_stage}{'o' if lay.offload_optimizer != 'none' else ''}"
        lines.append(
            f"{i:>3} {lay.tp:>3} {'y' if lay.sp else '-':>3} {cp:>3} {lay.pp:>4} {lay.vpp:>3} {lay.dp:>5} "
            f"{zero:>4} {lay.recompute:>9} {lay.micro_batch_size:>5} {p.memory_bytes / GIB:>6.1f} "
            f"{p.step.total_s:>8.3g} {p.tokens_per_s:>11,.0f} {p.tflops_per_gpu:>7.0f} {100 * p.mfu:>5.1f}% "
            f"{'≈' if near[i - 1] and i > 1 else '':>2}"
        )
        lines.append(f"      {' '.join(lay.overrides())}")
    lines.append(
        "cp 2u: Ulysses; zero 1o: optimizer offloaded to CPU. Memory and time are the planner's model "
        "(docs/planner.md)."
    )
    if fitting:
        basis = (
            f"the largest error of its step time measured on {cluster.gpu.name} (plan/measured.py)"
            if measured
            else f"the largest error measured on any GPU: {cluster.gpu.name} is not validated"
        )
        close = sum(near)
        lines.append(
            f"≈: within {100 * error:.0f}% of #1's step time, {basis}; the planner cannot rank the {close:,} "
            "layouts that close against each other: measure the ones you would run."
            if close > 1
            else f"No other layout is within {100 * error:.0f}% of #1's step time ({basis})."
        )
        caveat = multi_gpu_caveat(cluster.gpu.name) if cluster.world_size > 1 else ""
        if caveat:
            lines.append(f"That error is one GPU's: {caveat} (docs/planner.md).")
    if not fitting:
        lines.append(
            f"Nothing fits: the smallest needs {predictions[0].memory_bytes / GIB:.1f} GiB of the "
            f"{cluster.usable_bytes / GIB:.1f}; more GPUs (cluster.nodes), a GPU with more memory "
            "(cluster.gpu) or a shorter model.seq_len would make room (the search does not offload ZeRO-3's parameters: "
            "`train.py --check` a layout with zero.offload_param=cpu)."
        )
    return "\n".join(lines)
