"""Shared settings for the multi-rank trajectory tests: a tiny model, a short schedule, fp32 on CPU."""

# 8 sequences per step: accumulation 4 at dp=1, 2 at dp=2, 1 at dp=4 (same global batch every time).
BASE = [
    "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2",
    "optim.lr=3e-3", "checkpoint.interval=0", "checkpoint.resume=never", "logging.wandb.mode=disabled",
    "train.precision=fp32",
]


def overrides(tmp_path, name: str, *extra: str) -> list[str]:
    return [*BASE, f"run.dir={tmp_path}/{name}", *extra]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
