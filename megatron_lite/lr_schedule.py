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


SCHEDULE_KEYS = (
    ("train", "steps"),
    ("optim", "lr"),
    ("optim", "min_lr"),
    ("optim", "warmup_steps"),
    ("optim", "decay"),
)


def schedule_change(saved_config: dict, cfg: Config, step: int) -> str | None:
    """What a resume after optimizer step `step` does to the learning rate, when the schedule's settings differ
    from the saved run's and so does the next step's lr (say: raising train.steps stretches a cosine decay, and
    the lr jumps back up); None when the next lr is the saved schedule's."""
    from types import SimpleNamespace

    now = {group: vars(getattr(cfg, group)) for group in ("train", "optim")}
    saved = {group: {**now[group], **saved_config.get(group, {})} for group in now}
    changed = [f"{g}.{k}: {saved[g][k]} -> {now[g][k]}" for g, k in SCHEDULE_KEYS if saved[g][k] != now[g][k]]
    before = SimpleNamespace(**{g: SimpleNamespace(**saved[g]) for g in saved})
    lr_saved, lr_now = lr_at(step, before), lr_at(step, cfg)
    if not changed or math.isclose(lr_saved, lr_now, rel_tol=1e-9):
        return None
    return (
        f"this resume changes the learning-rate schedule ({'; '.join(changed)}): step {step + 1} trains at lr "
        f"{lr_now:.2e}, where the saved run's schedule gives {lr_saved:.2e} (step {step} had "
        f"{lr_at(step - 1, before):.2e})"
    )
