"""The host code of every Triton op (its autograd Function's forward and backward, around the kernel launches)
traces into one torch.compile graph, so that compiled blocks keep the fused kernels inside their graph.

On a GPU, dynamo takes a Triton launch as one op; on CPU it would trace into Triton's interpreter, so here each
@triton.jit kernel is swapped for a launcher that does nothing and only the host code is traced, with
fullgraph=True (a graph break is an error). The H100 run of tests/gpu found such a break: bias_gelu's
`torch.result_type` (an op returning a dtype) split every compiled GPT-2 block into pieces.
"""

import importlib

import pytest
import torch
import triton

from megatron_lite.kernels import OPS, ops


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **meta)` launches nothing."""

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **meta):
        return None


def _inputs(op: str) -> tuple:
    """Small CPU inputs in bf16 (as in training) for op, the ones that need grads requiring them."""

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    n, d = 8, 32
    if op == "rmsnorm":
        return (leaf(2, n, d), leaf(d, dtype=torch.float32), 1e-5)
    if op == "layernorm":
        return (leaf(2, n, d), leaf(d, dtype=torch.float32), leaf(d, dtype=torch.float32), 1e-5)
    if op == "rope":
        return (leaf(2, 4, n, 16), torch.randn(n, 16), torch.randn(n, 16))
    if op == "swiglu":
        return (leaf(2, n, 2 * d),)
    if op == "bias_gelu":
        return (leaf(2, n, d), leaf(d, dtype=torch.float32))
    assert op == "cross_entropy"
    return (leaf(n, 50), torch.randint(0, 40, (n,)), 40)


@pytest.mark.parametrize("op", OPS)
def test_triton_op_host_code_is_one_graph(op, monkeypatch):
    fn = ops._op(op, "triton")
    module = importlib.import_module(fn.__module__)
    kernels = [name for name, value in vars(module).items() if isinstance(value, triton.runtime.jit.KernelInterface)]
    assert kernels, f"{module.__name__} has no @triton.jit kernel to stand in for"
    for name in kernels:
        monkeypatch.setattr(module, name, _NoLaunch())
    args = _inputs(op)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # raises on any graph break
    out = compiled(*args)
    out.float().sum().backward()  # the compiled backward's host code runs too
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad is not None and a.grad.shape == a.shape, op
