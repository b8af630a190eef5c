"""The learning-rate schedule: linear warmup, then cosine, linear or constant decay to optim.min_lr.

A pure function of the optimizer step, so a resumed run needs no scheduler state (the step is in meta.json).
"""

from __future__ import annotations

import math

from megatron_lite.config import Config


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr at train.steps."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant" or total <= o.warmup_steps:
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if o.decay == "cosine" else 1.0 - progress
    return o.min_lr + (o.lr - o.min_lr) * factor
