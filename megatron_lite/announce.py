"""What a run says at its start, on rank 0: the resume and any change it makes to the data stream or the schedule,
the warnings of valid settings that do less than they seem, the restart, the layout with its precision, kernels
and float8, and the data (a blend's shares, a validation split too small for an evaluation).

`announce(trainer, ...)` reads the Trainer (training.py) once its engine, data and checkpoints are set up."""

from __future__ import annotations

import os

import numpy as np
import torch

from megatron_lite.checkpoint import resume as checkpoint_resume
from megatron_lite.config import data_paths
from megatron_lite.kernels import describe, resolve_backend
from megatron_lite.lr_schedule import schedule_change
from megatron_lite.validation import notes


def announce(trainer, resume_path: str | None, meta: dict | None, dtype: torch.dtype, peak_source: str) -> None:
    """What this run is: the resume (and any change to the data stream), the restart, the layout."""
    cfg, ctx, say, p = trainer.cfg, trainer.ctx, trainer.logger.print, trainer.cfg.parallel
    if trainer.start_step:
        say(
            f"resumed from {resume_path} at step {trainer.start_step} ({trainer.batches.consumed_samples} samples "
            "consumed)"
        )
        changes = (
            checkpoint_resume.data_stream_changes(meta.get("config", {}), cfg) if meta["kind"] == "deepspeed" else []
        )
        if changes:
            say(
                "warning: this resume changes the data stream (" + "; ".join(changes) + "): the steps from "
                f"{trainer.start_step + 1} see other samples (or masks) than the run that wrote the checkpoint would "
                "have"
            )
        lr_change = (
            schedule_change(meta.get("config", {}), cfg, trainer.start_step) if meta["kind"] == "deepspeed" else None
        )
        if lr_change:
            say(f"warning: {lr_change}")
    elif meta is not None and meta["kind"] == "weights":  # an import (step 0): its weights, all else afresh
        say(
            f"starting from the weights of {resume_path} (weights only: a new optimizer, schedule and data "
            "stream from step 1)"
        )
    for note in notes(cfg):
        say(f"warning: {note}")
    if trainer.start_step >= cfg.train.steps:
        say(
            f"nothing to do: the checkpoint resumed ({resume_path}) is at step {trainer.start_step} of train.steps="
            f"{cfg.train.steps}; raise train.steps, or use another run.dir / checkpoint.resume=never"
        )
    pipeline = (
        f", vpp {p.vpp}, {trainer.engine.executor.schedule_name} schedule, layers per virtual stage "
        f"{list(trainer.layout.layers_per_stage)}"
        if ctx.pp_size > 1
        else ""
    )
    context = f", cp {ctx.cp_size} ({p.cp_mode})" if ctx.cp_size > 1 else ""
    if trainer.restarts:
        say(
            f"restart {trainer.restarts} of this job (torchrun: {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}, "
            f"Slurm requeues: {os.environ.get('SLURM_RESTART_COUNT', 0)})"
        )
    say(
        f"{cfg.model.name}: world {ctx.world_size} (dp {ctx.dp_size}, tp {ctx.tp_size}{context}, pp "
        f"{ctx.pp_size}{pipeline}), zero {cfg.zero.stage}, {dtype}, accumulation {trainer.engine.accum}, kernels "
        f"{describe(resolve_backend(cfg.kernels.backend, ctx.device))}{_fp8_said(trainer)}; peak "
        f"{trainer.peak / 1e12:.2f} TFLOP/s per device ({peak_source})"
    )
    paths = data_paths(cfg.data.path)
    shares = np.asarray(trainer.data.weights, dtype=np.float64) / sum(trainer.data.weights)
    if trainer.data.val_samples is not None:  # the validation set wraps around a split smaller than it
        needed = cfg.train.eval_iters * cfg.train.global_batch_size
        short = [
            f"{path} holds {n} for its {share * needed:.0f}"
            for path, n, share in zip(paths, trainer.data.val_samples, shares)
            if n < share * needed
        ]
        if short:
            say(
                f"warning: an evaluation reads train.eval_iters x train.global_batch_size = {needed} validation "
                f"samples, more than the validation split has ({'; '.join(short)}): some count more than "
                "once; prepare the data with a larger --val-fraction, or lower train.eval_iters"
            )
    if len(paths) > 1:  # each dataset's share and how often the run will have read it
        samples = cfg.train.steps * cfg.train.global_batch_size
        say(
            f"data: a blend of {len(paths)}: "
            + "; ".join(
                f"{path} {share:.1%} of the samples ({n:,} of its own: {share * samples / n:.2f} epochs by step "
                f"{cfg.train.steps})"
                for path, share, n in zip(paths, shares, trainer.data.samples)
            )
        )


def _fp8_said(trainer) -> str:
    if trainer.cfg.train.fp8 == "none":
        return ""
    emulated = ", emulated" if trainer.ctx.device.type != "cuda" else ""
    return f", fp8 {trainer.cfg.train.fp8} ({trainer.fp8_projections} projections{emulated})"
