"""The model's entry to the fused kernels: one function per op, dispatching on `backend` ("torch" runs the
kernel file's reference, "triton" its kernel). Kept apart from the package __init__ so that importing a
kernel module (kernels.swiglu) never shadows a dispatch function of the same name."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from kernels import BACKENDS


_RESOLVED: dict[tuple[str, str, str], Callable] = {}  # (module, name, backend) -> function, once imported


def _op(module: str, name: str, backend: str) -> Callable:
    """The function that runs op `name` of kernels/<module>.py on `backend`. After its first call a plain dict
    lookup, which torch.compile traces through (it cannot trace importlib: every op would break the graph)."""
    fn = _RESOLVED.get((module, name, backend))
    if fn is None:
        assert backend in BACKENDS, backend
        suffix = "triton" if backend == "triton" else "reference"
        fn = _RESOLVED[module, name, backend] = getattr(importlib.import_module(f"kernels.{module}"), f"{name}_{suffix}")
    return fn


_MODULES = {"rms_norm": "rmsnorm", "layer_norm": "layernorm", "apply_rope": "rope", "swiglu": "swiglu",
            "bias_gelu": "gelu", "cross_entropy": "cross_entropy"}


def preload(backends) -> None:
    """Resolve every op for each of `backends` now (GPT.compile_blocks does, before anything is traced)."""
    for backend in set(backends):
        for name, module in _MODULES.items():
            _op(module, name, backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    return _op("rmsnorm", "rms_norm", backend)(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               backend: str = "torch") -> torch.Tensor:
    return _op("layernorm", "layer_norm", backend)(x, weight, bias, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """x (b, heads, s, hd) rotated by the (s, hd) cos/sin tables (rotate-half layout)."""
    return _op("rope", "apply_rope", backend)(x, cos, sin)


def swiglu(h: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] (..., 2f) -> (..., f)."""
    return _op("swiglu", "swiglu", backend)(h)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, backend: str = "torch") -> torch.Tensor:
    """tanh GeLU of x + bias."""
    return _op("gelu", "bias_gelu", backend)(x, bias)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, n_valid: int | None = None,
                  backend: str = "torch") -> torch.Tensor:
    """Per-token fp32 loss (N,) over the first n_valid columns of logits (N, V). The Triton kernel overwrites
    the logits with their gradient in backward: pass logits that nothing else uses."""
    return _op("cross_entropy", "cross_entropy", backend)(logits, labels, n_valid)
