"""The model's entry to the fused kernels: one function per op, dispatching on `backend` ("torch" runs the
kernel file's reference, "triton" its kernel). Kept apart from the package __init__ so that importing a
kernel module (kernels.swiglu) never shadows a dispatch function of the same name."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from megatron_lite.kernels import BACKENDS, OPS

# Each op of OPS: the file in this package that holds it and its functions' stem (<stem>_triton, <stem>_reference).
_SOURCES = {
    "rmsnorm": ("rmsnorm", "rms_norm"),
    "layernorm": ("layernorm", "layer_norm"),
    "rope": ("rope", "apply_rope"),
    "swiglu": ("swiglu", "swiglu"),
    "bias_gelu": ("gelu", "bias_gelu"),
    "cross_entropy": ("cross_entropy", "cross_entropy"),
}
_RESOLVED: dict[tuple[str, str], Callable] = {}  # (op, backend) -> function, once imported


def _op(op: str, backend: str) -> Callable:
    """The function that runs `op` on `backend`. After its first call a plain dict lookup, which torch.compile
    traces through (it cannot trace importlib: every op would break the graph)."""
    fn = _RESOLVED.get((op, backend))
    if fn is None:
        assert backend in BACKENDS, backend
        module, stem = _SOURCES[op]
        suffix = "triton" if backend == "triton" else "reference"
        fn = _RESOLVED[op, backend] = getattr(importlib.import_module(f"{__package__}.{module}"), f"{stem}_{suffix}")
    return fn


def preload(backends) -> None:
    """Resolve every op for each of `backends` now (GPT.compile_blocks does, before anything is traced)."""
    for backend in set(backends):
        for op in OPS:
            _op(op, backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    return _op("rmsnorm", backend)(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, backend: str = "torch"
) -> torch.Tensor:
    return _op("layernorm", backend)(x, weight, bias, eps)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch", positions: torch.Tensor | None = None
) -> torch.Tensor:
    """x (b, heads, s, hd) rotated by the (s, hd) cos/sin tables (rotate-half layout); given positions (b, s), token
    t of sample b takes table row positions[b, t] (data.document_mask) instead of row t."""
    if positions is None:
        return _op("rope", backend)(x, cos, sin)
    return _op("rope", backend)(x, cos, sin, positions)


def swiglu(h: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] (..., 2f) -> (..., f)."""
    return _op("swiglu", backend)(h)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, backend: str = "torch") -> torch.Tensor:
    """tanh GeLU of x + bias."""
    return _op("bias_gelu", backend)(x, bias)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, n_valid: int | None = None, backend: str = "torch"
) -> torch.Tensor:
    """Per-token fp32 loss (N,) over the first n_valid columns of logits (N, V). The Triton kernel overwrites
    the logits with their gradient in backward: pass logits that nothing else uses."""
    return _op("cross_entropy", backend)(logits, labels, n_valid)
