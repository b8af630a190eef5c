"""Fused kernels (Triton) with torch references; `kernels.backend` picks which one runs.

Each kernel will live in its own file here: the @triton.jit kernel, its launcher, the autograd wrapper and
the plain torch reference the tests compare against. This release ships the dispatch rule only; every op
runs its torch reference. (This top-level package shadows PyPI's unrelated `kernels` package.)
"""

from __future__ import annotations

import torch


def resolve_backend(requested: str, device: torch.device) -> str:
    """`auto` means Triton on CUDA and torch elsewhere; `triton` and `torch` are taken as given."""
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return requested
