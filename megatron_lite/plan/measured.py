"""Our own step times, measured on lent GPUs by `make bench-gpu` (bench/results/gpu_*.json), held against what the
planner predicts for the same runs; and from them, how far the planner's step time can be trusted on each GPU
class, which `--plan` reports its ranking with (plan/report.py).

Each row is one GPU, bf16, the default kernels (or compiled blocks), ZeRO-0 or ZeRO-1, at the preset's sequence
length. `make bench-gpu` records the planner's prediction beside each of our rows it measures
(`predicted_step_s`, `predicted_error`): a GPU session adds its rows here, and the errors below follow. Published runs on A100s (plan/published.py) give that class's error; a GPU with no row of either kind
takes the largest error of any class, and is said to be unvalidated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredRun:
    gpu: str  # plan/hardware.GPUS name
    source: str  # the results file and the commit it measured
    model: str  # a preset
    side: str  # bench_gpu's name for the configuration
    micro_batch: int
    global_batch: int
    zero_stage: int
    step_s: float

    def overrides(self) -> list[str]:
        return [
            f"model={self.model}",
            f"train.micro_batch_size={self.micro_batch}",
            f"train.global_batch_size={self.global_batch}",
            f"zero.stage={self.zero_stage}",
            "train.precision=bf16",
            f"cluster.gpu={self.gpu}",
        ]


H100 = "bench/results/gpu_h100_80gb_hbm3.json (f4f137b, 2026-11-26)"
H200 = "bench/results/gpu_h200.json (e5adc0e, 2026-11-28)"
MEASURED = (
    MeasuredRun("h100-sxm", H100, "gpt-1.3b", "ours-auto", 4, 4, 0, 0.16967),
    MeasuredRun("h100-sxm", H100, "gpt-1.3b", "ours-compile", 4, 4, 0, 0.15669),
    MeasuredRun("h100-sxm", H100, "gpt-1.3b", "ours-zero1", 4, 4, 1, 0.16572),
    MeasuredRun("h100-sxm", H100, "gpt2-124m", "ours-auto", 8, 8, 0, 0.02598),
    MeasuredRun("h100-sxm", H100, "gpt2-124m", "ours-compile", 8, 8, 0, 0.02406),
    MeasuredRun("h100-sxm", H100, "gpt2-124m", "ours-zero1", 8, 8, 1, 0.02779),
    MeasuredRun("h200", H200, "gpt-1.3b", "ours-auto", 4, 4, 0, 0.15153),
    MeasuredRun("h200", H200, "gpt-1.3b", "ours-compile", 4, 4, 0, 0.14446),
    MeasuredRun("h200", H200, "gpt-1.3b", "ours-compile-global16", 4, 16, 0, 0.54645),
    MeasuredRun("h200", H200, "gpt-1.3b", "ours-zero1", 4, 4, 1, 0.15257),
)


def predict_run(overrides: list[str]):
    """The planner's Prediction for a one-GPU run of `overrides` (cluster.gpu=auto: this machine's GPU), as
    `make bench-gpu` records it beside what it measures (tools/bench_gpu.py)."""
    from megatron_lite.cli import load
    from megatron_lite.layout import Layout
    from megatron_lite.plan import cluster_from_config, predict

    cfg = load([*overrides, "cluster.gpus_per_node=1"], world_size=1)
    return predict(cfg.model, Layout.of_run(cfg, 1, cuda=True), cluster_from_config(cfg.cluster, 1))


def predicted_step_s(run: MeasuredRun) -> float:
    """The planner's step time for `run` (one GPU of its class, its layout and model)."""
    return predict_run(run.overrides()).step.total_s


@functools.cache
def step_errors() -> dict[str, float]:
    """GPU class -> the largest |predicted / measured - 1| of its step time (published runs' throughput for the
    A100s), over the rows above and plan/published.py's."""
    from megatron_lite.plan.published import KORTHIKANTI_2022, NARAYANAN_2021, row

    out: dict[str, float] = {}
    for run in MEASURED:
        error = abs(predicted_step_s(run) / run.step_s - 1)
        out[run.gpu] = max(out.get(run.gpu, 0.0), error)
    for run in NARAYANAN_2021 + KORTHIKANTI_2022:
        error = abs(row(run, pick=False)["error"])
        for gpu in ("a100-40gb", "a100-80gb"):  # the same chip; the papers ran the 80 GB part
            out[gpu] = max(out.get(gpu, 0.0), error)
    return out


@functools.cache
def multi_gpu_caveat(gpu: str) -> str:
    """What the error of step_error says nothing about, for a layout on more than one GPU: for a class measured on
    one GPU only (MEASURED), how much longer published fully sharded runs on several of its GPUs took than the
    planner predicts for their layouts (plan/published_fsdp.py), or that none has been held against it. Empty for
    the A100s, whose error comes from published runs on 8 to 3,072 GPUs."""
    from megatron_lite.plan.published_fsdp import MOSAIC_H100, fsdp_row

    if gpu.startswith("a100"):
        return ""
    rows = [fsdp_row(run) for run in MOSAIC_H100 if run.gpu == gpu]
    if not rows:
        return f"no run on several {gpu}s has been held against the planner"
    gpus, errors = [r["gpus"] for r in rows], [100 * r["error"] for r in rows]
    return (
        f"MosaicML's published FSDP runs on {min(gpus)}-{max(gpus)} {gpu}s took "
        f"{min(errors):.0f}-{max(errors):.0f}% longer than predicted for their layouts"
    )


def step_error(gpu: str) -> tuple[float, bool]:
    """(the planner's measured step-time error on `gpu`'s class, whether that class has been measured at all);
    an unmeasured class gets the largest error of any."""
    errors = step_errors()
    return (errors[gpu], True) if gpu in errors else (max(errors.values()), False)
