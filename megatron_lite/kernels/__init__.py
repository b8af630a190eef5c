"""Fused kernels (Triton) with torch references; `kernels.backend` picks which one runs.

One file per kernel: the @triton.jit kernel(s), the launcher, the autograd wrapper and the plain torch
reference the tests compare against (rmsnorm, layernorm, rope, swiglu, gelu, cross_entropy). `kernels.ops`
dispatches on a backend string: "torch" runs the reference, "triton" the kernel; `resolve_backend` says
which one each op uses. Kernel modules are
imported lazily, so the torch backend never imports Triton.

On a machine without a GPU, Triton runs in its interpreter (TRITON_INTERPRET=1, set before triton is first
imported): slow, and meant for tests. Attention stays on torch's scaled_dot_product_attention (flash on
GPU); a Triton attention would have to beat it on a GPU first, and none was measured.

This package lives inside megatron_lite, not at the repository's top: a top-level `kernels` would be Hugging Face's
package (transformers requires it) to any script run from the root, and shadow it (README, Installing).
"""

from __future__ import annotations

import torch

BACKENDS = ("torch", "triton")
OPS = ("rmsnorm", "layernorm", "rope", "swiglu", "bias_gelu", "cross_entropy")

# The ops whose Triton kernel measured faster than torch eager, forward + backward, in bf16 at gpt-1.3b's shapes,
# both in GPU time and per call (launch work included), on an H200 (tools/bench_kernels.py in
# bench/results/gpu_h200.md; GPU time / per call: rmsnorm 8.99x / 1.62x, rope 9.83x / 1.84x, swiglu 3.22x / 3.19x,
# cross_entropy 4.33x / 4.32x). Layernorm (1.23x / 0.32x) and bias_gelu (1.64x / 0.88x) are faster on the GPU but
# slower per call, and gpt-1.3b with every op on Triton measured no faster (1.5% slower, inside the 6-10% spread
# of its step times), so `auto` keeps torch there. On an H100 (bench/results/gpu_h100_80gb_hbm3.md) this choice
# was the fastest eager side at both GPT-2 models, in two runs: gpt-1.3b 169.9 / 169.7 ms a step against 174.3 /
# 174.6 (all torch) and 175.7 / 175.8 (all Triton), gpt2-124m 36.5 / 26.0 against 37.3 / 33.2 and 46.1 / 32.2.
TRITON_FASTER_ON_CUDA = frozenset({"rmsnorm", "rope", "swiglu", "cross_entropy"})


def resolve_backend(requested: str, device: torch.device) -> dict[str, str]:
    """{op: "torch" or "triton"} for every op in OPS. `triton` and `torch` are taken as given for every op;
    `auto` picks Triton on CUDA for the ops measured faster there, torch everywhere else (on CPU the kernels run
    only in Triton's interpreter)."""
    if requested != "auto":
        return dict.fromkeys(OPS, requested)
    return {op: "triton" if device.type == "cuda" and op in TRITON_FASTER_ON_CUDA else "torch" for op in OPS}


def describe(choice: dict[str, str]) -> str:
    """`torch`, `triton`, or which ops run which (for the start-up line)."""
    chosen = set(choice.values())
    if len(chosen) == 1:
        return chosen.pop()
    return "; ".join(f"{b} for {', '.join(op for op in OPS if choice[op] == b)}" for b in BACKENDS)
