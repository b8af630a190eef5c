"""train.*, dist.* and optim.*: batch and steps, precision, recompute, float8, evaluation, profiling, timeouts,
and the optimizer and its schedule."""

from __future__ import annotations

import importlib.util
import math

from megatron_lite.config import Config, OptimConfig
from megatron_lite.layout import resolve_precision
from megatron_lite.parallel.fp8 import CHOICES
from megatron_lite.validation.rules import choice, fail, has_gpu, positive


def check_train(cfg: Config, world_size: int, dp: int) -> None:
    t = cfg.train
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, key) <= 0:
            fail(f"train.{key}", getattr(t, key), "must be positive", "pick a positive integer")
    if t.global_batch_size % (t.micro_batch_size * dp):
        fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"must be a multiple of train.micro_batch_size={t.micro_batch_size} x dp={dp}",
            f"use {t.micro_batch_size * dp * max(1, t.global_batch_size // (t.micro_batch_size * dp))}"
            " or change train.micro_batch_size",
        )
    choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    choice("train.recompute", t.recompute, ("none", "selective", "full"))
    if t.recompute_every < 1:
        fail("train.recompute_every", t.recompute_every, "must be >= 1", "use 1 (every layer) or k (every k-th)")
    for key in ("timeout_s", "step_timeout_s"):
        if getattr(cfg.dist, key) < 1:
            fail(f"dist.{key}", getattr(cfg.dist, key), "must be >= 1 (seconds)", "use e.g. 600 / 300")
    if t.max_skipped_in_row < 0:
        fail("train.max_skipped_in_row", t.max_skipped_in_row, "must be >= 0", "use 5, or 0 to never stop")
    if t.compile and cfg.zero.stage == 3:
        fail(
            "train.compile",
            True,
            "does not work with zero.stage=3 (ZeRO-3 gathers and frees parameters in "
            "module hooks that a compiled block would trace through)",
            "use zero.stage=1 or 2, or train.compile=false",
        )
    check_fp8(cfg)
    if not (math.isfinite(t.grad_clip) and t.grad_clip >= 0):  # nan compared false: clipping silently off
        fail("train.grad_clip", t.grad_clip, "must be a finite number >= 0", "use 1.0, or 0 to disable clipping")
    if t.eval_interval < 0 or t.eval_iters <= 0:
        key, val = (
            ("train.eval_interval", t.eval_interval) if t.eval_interval < 0 else ("train.eval_iters", t.eval_iters)
        )
        fail(key, val, "is out of range", "eval_interval >= 0 (0 = never), eval_iters >= 1")
    if t.log_interval <= 0:
        fail("train.log_interval", t.log_interval, "must be positive", "use 1")
    if t.profile_steps is not None:
        steps = list(t.profile_steps)
        if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1]:
            fail(
                "train.profile_steps",
                steps,
                "must be [first, last] steps with 1 <= first <= last",
                "use e.g. [5,7] (after the first step's warm-up), or null",
            )
    bad_ranks = [r for r in t.profile_ranks if not (isinstance(r, int) and 0 <= r < world_size)]
    if bad_ranks or not t.profile_ranks:
        fail(
            "train.profile_ranks",
            list(t.profile_ranks),
            f"must name ranks of the {world_size} in this run",
            "use e.g. [0]" + (f" or [0,{world_size - 1}]" if world_size > 1 else ""),
        )


def check_fp8(cfg: Config) -> None:
    """train.fp8: a recipe torchao has, installed, and a GPU that multiplies float8 (or a CPU, which emulates
    it)."""
    recipe = cfg.train.fp8
    choice("train.fp8", recipe, CHOICES)
    if recipe == "none":
        return
    if importlib.util.find_spec("torchao") is None:
        fail("train.fp8", recipe, "needs torchao (torchao.float8), which is not installed", "run `make install`")
    if has_gpu():
        import torch

        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            fail(
                "train.fp8",
                recipe,
                f"needs a GPU of compute capability 8.9 or newer (H100, L40S); this one is {capability[0]}.{capability[1]}",
                "use train.fp8=none",
            )
        if recipe != "tensorwise" and resolve_precision(cfg.train.precision) == "fp32":
            fail(
                "train.fp8",
                recipe,
                "needs bf16 on a GPU (torch._scaled_mm's rowwise scaling writes bf16), not train.precision=fp32",
                "use train.precision=bf16 (or auto), or train.fp8=tensorwise",
            )


def check_optim(o: OptimConfig) -> None:
    if not (o.lr > 0 and math.isfinite(o.lr)):
        fail("optim.lr", o.lr, "must be a positive number", "use e.g. 3e-4")
    if not 0 <= o.min_lr <= o.lr:  # nan too (an lr of nan after warmup)
        fail("optim.min_lr", o.min_lr, f"must be in [0, optim.lr={o.lr}]", "use e.g. optim.lr / 10")
    if o.warmup_steps < 0:
        fail("optim.warmup_steps", o.warmup_steps, "must be >= 0", "use e.g. 1% of train.steps")
    choice("optim.decay", o.decay, ("cosine", "linear", "constant"))
    if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0):
        fail("optim.weight_decay", o.weight_decay, "must be a finite number >= 0", "use e.g. 0.1, or 0 for none")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", list(o.betas), "must be two numbers in [0, 1)", "use [0.9,0.95]")
    positive("optim.eps", o.eps, "1e-8")
