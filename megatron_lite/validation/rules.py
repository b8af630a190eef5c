"""The helpers every group's checks share: the one-line ConfigError and the common tests of a value."""

from __future__ import annotations

import math
import os

from megatron_lite.errors import ConfigError


def fail(key: str, value, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value} {why}; {fix}")


def positive(key: str, value: float, example: str) -> None:
    if not (math.isfinite(value) and value > 0):
        fail(key, value, "must be a positive number", f"use e.g. {example}")


def choice(key: str, value, allowed) -> None:
    if value not in allowed:
        fail(key, value, "is not a valid choice", f"use one of {', '.join(map(str, allowed))}")


def divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def writable(key: str, path: str) -> None:
    """A directory the run will write (it may not exist yet): not a file, and its nearest existing ancestor
    writable, so that a read-only mount is said now, not at the first save after hours of training."""
    if not path:  # os.makedirs("") fails: at start-up for run.dir, at the first save for checkpoint.dir
        fail(
            key,
            "''",
            "is empty",
            f"give a directory, e.g. {key}=runs/mine" + ("/checkpoints" if key == "checkpoint.dir" else ""),
        )
    if os.path.exists(path) and not os.path.isdir(path):
        fail(key, path, "is a file, not a directory", f"use another {key}")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        fail(
            key,
            path,
            f"cannot be written ({existing} is {'read-only' if os.path.isdir(existing) else 'a file'})",
            f"use a writable {key}",
        )


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
