"""rope.py, swiglu.py and gelu.py (megatron_lite/kernels/) against their torch references: outputs and every
input gradient, fp32 and bf16, odd shapes (rows not a multiple of the tile, widths not powers of two), and
RoPE on the transposed (b, heads, s, hd) view the attention layer passes.

Measured max |diff| against the reference on these inputs (CPU interpreter; relative = |diff| / max(|ref|, 1)):
  fp32  RoPE 0 for output and grad (the same fp32 products and sums: bitwise equal, asserted below);
        SwiGLU output 7.6e-6 (rel 2.9e-7; outputs reach ~80), grad 7.6e-6 (rel 8.4e-7);
        GeLU output 4.8e-7, grad x 2.1e-6, grad bias 1.1e-5 (rel 4.0e-7; sums of up to 111 rows).
        The SwiGLU and GeLU gradients are closer to fp64 than torch's own (see the kernels' comments), so
        part of these gaps is the reference's rounding.
  bf16  at most 1.5e-2 relative (two bf16 ulps): the reference rounds intermediates to bf16 (silu before
        the product; the two halves of the RoPE gradient before their sum), and the interpreter truncates
        fp32 -> bf16 on store where torch and Triton on a GPU round to nearest even.
"""

import os

import pytest
import torch

from megatron_lite.model.positions import rope_cos_sin

# The interpreter evaluates tl.sigmoid with numpy, whose exp warns when it overflows to inf for very negative
# arguments; the sigmoid is then exactly 0, which is the right answer (checked in the extremes test).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# fp32: both sides do the same fp32 math up to operation order; bf16: up to two bf16 ulps apart (see above).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _leaves(*tensors):
    """Two independent leaf copies of each input: one for the kernel, one for the reference."""
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors], [
        t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors
    ]


def _check(fn, ref_fn, inputs, function_name, dtype, seed):
    """Run fn and ref_fn on copies of inputs; compare outputs and the gradients of all floating inputs."""
    ours, refs = _leaves(*inputs)
    out, ref = fn(*ours), ref_fn(*refs)
    assert type(out.grad_fn).__name__ == f"{function_name}Backward", "the Triton path must have run"
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(grad)
    ref.backward(grad)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for mine, theirs in zip(ours, refs):
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, heads, s, hd", [(2, 3, 37, 16), (1, 5, 67, 80), (2, 2, 130, 64)])
def test_rope_matches_reference(device, dtype, b, heads, s, hd):
    from megatron_lite.kernels.rope import apply_rope_reference, apply_rope_triton

    cos, sin = rope_cos_sin(s, hd, 10000.0, device=device)
    gen = torch.Generator().manual_seed(s)
    # The model's layout: a transpose of the (b, s, heads, hd) projection, so x is not contiguous.
    x = torch.randn(b, s, heads, hd, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    assert not x.is_contiguous()
    ours, refs = _leaves(x)
    out = apply_rope_triton(ours[0], cos, sin)
    assert out.stride() == apply_rope_reference(x, cos, sin).stride()  # the same layout as the reference
    _check(
        lambda t: apply_rope_triton(t, cos, sin),
        lambda t: apply_rope_reference(t, cos, sin),
        [x],
        "_RoPE",
        dtype,
        seed=hd,
    )
    if dtype == torch.float32 and device == "cpu":  # the same fp32 products and sums: equal bit for bit
        assert torch.equal(out, apply_rope_reference(x, cos, sin))
    elif dtype == torch.float32:  # the GPU compiler contracts x1 c - x2 s into an FMA: one rounding fewer
        want = apply_rope_reference(x, cos, sin)
        ulps = (out - want).abs().max() / (torch.finfo(torch.float32).eps * x.abs().max())
        assert ulps <= 4, f"{ulps:.1f} ulps of the largest input"


@pytest.mark.parametrize("device", DEVICES)
def test_rope_rows_of_a_strided_split(device):
    """q from a fused qkv projection: a split of the last dim, viewed and transposed (no dense layout)."""
    from megatron_lite.kernels.rope import apply_rope_reference, apply_rope_triton

    b, s, heads, hd = 2, 19, 3, 16
    qkv = torch.randn(b, s, 3 * heads * hd, device=device)
    q = qkv[..., : heads * hd].view(b, s, heads, hd).transpose(1, 2)  # (b, heads, s, hd), row stride 3*heads*hd
    cos, sin = rope_cos_sin(s, hd, 10000.0, device=device)
    _check(
        lambda t: apply_rope_triton(t, cos, sin),
        lambda t: apply_rope_reference(t, cos, sin),
        [q],
        "_RoPE",
        torch.float32,
        seed=0,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, f", [((3, 37), 96), ((45,), 777), ((2, 5), 130)])
def test_swiglu_matches_reference(device, dtype, shape, f):
    from megatron_lite.kernels.swiglu import swiglu_reference, swiglu_triton

    h = (torch.randn(*shape, 2 * f, generator=torch.Generator().manual_seed(f)) * 3).to(device=device, dtype=dtype)
    _check(swiglu_triton, swiglu_reference, [h], "_SwiGLU", dtype, seed=f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_reference_is_autograds_and_keeps_only_h(dtype):
    """The torch path's own backward (which keeps h and recomputes silu(gate)) gives autograd's gradient of
    silu(gate) * up bit for bit, and saves one tensor, h, where autograd's graph also saved silu(gate)."""
    from megatron_lite.kernels.swiglu import swiglu_reference

    h = (torch.randn(3, 7, 2 * 40, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    g = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours, plain = h.clone().requires_grad_(), h.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu_reference(ours)
    gate, up = plain.chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(out, expected)
    out.backward(g)
    expected.backward(g)
    assert torch.equal(ours.grad, plain.grad)
    assert len(saved) == 1 and saved[0].shape == h.shape


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_gradient_is_one_buffer_laid_out_like_h(device):
    from megatron_lite.kernels.swiglu import swiglu_triton

    h = torch.randn(4, 6, 2 * 50, device=device, requires_grad=True)
    swiglu_triton(h).sum().backward()  # a stride-0 (expanded) incoming gradient
    assert h.grad.shape == h.shape and h.grad.is_contiguous()
    gate, _ = h.detach().chunk(2, -1)
    torch.testing.assert_close(h.grad[..., 50:], torch.nn.functional.silu(gate), **TOL[torch.float32])  # d up


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, n, with_bias", [((3, 37), 96, True), ((45,), 777, True), ((2, 33), 130, False)])
def test_bias_gelu_matches_reference(device, dtype, shape, n, with_bias):
    from megatron_lite.kernels.gelu import bias_gelu_reference, bias_gelu_triton

    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(*shape, n, generator=gen) * 3).to(device=device, dtype=dtype)
    if with_bias:
        bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        _check(bias_gelu_triton, bias_gelu_reference, [x, bias], "_BiasGeLU", dtype, seed=n)
    else:
        _check(
            lambda t: bias_gelu_triton(t, None), lambda t: bias_gelu_reference(t, None), [x], "_BiasGeLU", dtype, seed=n
        )


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_extremes_and_determinism(device):
    """Large |x| saturates without inf/NaN (sigmoid form of tanh); d bias is the same on every run."""
    from megatron_lite.kernels.gelu import bias_gelu_reference, bias_gelu_triton

    x = torch.tensor([[-1e4, -30.0, -5.0, 0.0, 5.0, 30.0, 1e4]] * 70, device=device)
    bias = torch.zeros(7, device=device, requires_grad=True)
    out = bias_gelu_triton(x, bias)
    torch.testing.assert_close(out, bias_gelu_reference(x, bias.detach()), **TOL[torch.float32])
    out.sum().backward()
    first = bias.grad.clone()
    bias.grad = None
    bias_gelu_triton(x, bias).sum().backward()
    assert torch.isfinite(first).all() and torch.equal(first, bias.grad)
