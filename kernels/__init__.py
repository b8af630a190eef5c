"""Fused kernels (Triton) with torch references; `kernels.backend` picks which one runs.

One file per kernel: the @triton.jit kernel(s), the launcher, the autograd wrapper and the plain torch
reference the tests compare against (rmsnorm, layernorm, rope, swiglu, gelu, cross_entropy). `kernels.ops`
dispatches on a backend string: "torch" runs the reference, "triton" the kernel. Kernel modules are
imported lazily, so the torch backend never imports Triton.

On a machine without a GPU, Triton runs in its interpreter (TRITON_INTERPRET=1, set before triton is first
imported): slow, and meant for tests. Attention stays on torch's scaled_dot_product_attention (flash on
GPU); a Triton attention would have to beat it on a GPU first, and none was measured.

This top-level package shadows PyPI's unrelated `kernels` package (which transformers probes for); the two
cannot be installed side by side.
"""

from __future__ import annotations

import torch

BACKENDS = ("torch", "triton")


def resolve_backend(requested: str, device: torch.device) -> str:
    """`auto` means torch everywhere until the Triton kernels have passed tests/gpu and tools/bench_kernels.py on
    a real GPU (they have only run in Triton's CPU interpreter so far); `triton` and `torch` are taken as given."""
    del device  # auto will choose Triton on CUDA once that is verified, in the commit that records the figures
    if requested == "auto":
        return "torch"
    return requested
