"""Triton's GPU compiler refuses a kernel that reads a module global which is not a `tl.constexpr` (a plain
float, say); its CPU interpreter accepts it, so the CPU tests alone missed this once (megatron_lite/kernels/gelu.py's
constants failed every GeLU launch on the first H100). This reads every @triton.jit kernel's globals."""

import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from megatron_lite import kernels

MODULES = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
KERNEL_TYPES = (triton.runtime.JITFunction, InterpretedFunction)  # the latter under TRITON_INTERPRET=1
ALLOWED = (types.ModuleType, tl.constexpr, *KERNEL_TYPES, type(None))


def jit_kernels():
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, KERNEL_TYPES) and obj.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def test_there_are_kernels_to_check():
    names = [name for name, _ in jit_kernels()]
    assert len(names) >= 8, names  # the fused norms, pointwise ops and cross entropy


@pytest.mark.parametrize("name,kernel", list(jit_kernels()), ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_reads_only_constexpr_globals(name, kernel):
    fn = kernel.fn
    bad = [
        g
        for g in fn.__code__.co_names
        if g in fn.__globals__ and not isinstance(fn.__globals__[g], ALLOWED) and not callable(fn.__globals__[g])
    ]
    assert not bad, (
        f"{name} reads module globals {bad} that are not tl.constexpr: Triton's compiler refuses them "
        "on a GPU (wrap each as tl.constexpr(value))"
    )
