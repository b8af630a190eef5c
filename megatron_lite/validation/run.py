"""seed, checkpoint.*, run.dir, logging.*, kernels.* and faults.*: what the run writes, where, what it runs with,
and what it does about a slow rank."""

from __future__ import annotations

import math
import os

from megatron_lite.checkpoint.store import meta_problem
from megatron_lite.config import Config
from megatron_lite.validation.rules import choice, fail, has_gpu, writable


def check_run(cfg: Config) -> None:
    if not 0 <= cfg.seed < 2**63:  # numpy's generators refuse a negative seed, torch's one past 64 bits
        fail("seed", cfg.seed, "must be in [0, 2**63)", "use e.g. seed=1234")
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.keep < 0:
        key = "checkpoint.interval" if cfg.checkpoint.interval < 0 else "checkpoint.keep"
        fail(key, getattr(cfg.checkpoint, key.split(".")[1]), "must be >= 0", "use 0 to disable")
    r = cfg.checkpoint.resume
    if r not in ("auto", "never") and not os.path.isfile(os.path.join(r, "meta.json")):
        fail(
            "checkpoint.resume",
            r,
            "is not a complete checkpoint directory (no meta.json)",
            "use auto, never, or a path to a step_<N> directory",
        )
    problem = meta_problem(r) if r not in ("auto", "never") else None
    if problem is not None:
        fail(
            "checkpoint.resume",
            r,
            f"cannot be loaded: {problem}",
            "resume another checkpoint, or checkpoint.resume=auto",
        )
    for key, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):  # (the second in the first)
        writable(key, path)
    choice("logging.wandb.mode", cfg.logging.wandb.mode, ("auto", "offline", "online", "disabled"))
    choice("kernels.backend", cfg.kernels.backend, ("auto", "triton", "torch"))
    if cfg.kernels.backend == "triton" and not has_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
        fail(
            "kernels.backend",
            "triton",
            "needs a GPU, or Triton's CPU interpreter (slow; for tests)",
            "use kernels.backend=auto, or export TRITON_INTERPRET=1 before starting",
        )


def check_faults(cfg: Config) -> None:
    f = cfg.faults
    ratio = f.straggler_ratio
    if ratio is not None and not (math.isfinite(ratio) and ratio > 1):
        fail(
            "faults.straggler_ratio",
            ratio,
            "must be a number > 1 (a rank's busy time over the median rank's)",
            "use e.g. 1.2, or null to measure nothing",
        )
    if f.straggler_intervals < 1:
        fail("faults.straggler_intervals", f.straggler_intervals, "must be >= 1 (reports in a row)", "use e.g. 5")
    choice("faults.straggler_action", f.straggler_action, ("warn", "stop"))
