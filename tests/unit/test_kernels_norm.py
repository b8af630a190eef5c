"""rmsnorm.py and layernorm.py (megatron_lite/kernels/) against their torch references: output, d x, d weight and
d bias, fp32 and bf16, rows not a multiple of the row tile and widths that are not powers of two.

fp32 is compared with the reference on the same inputs. bf16 is compared with the fp32 reference of the
same bf16 inputs (and bf16 incoming gradient), i.e. with what the kernel would give with no rounding at all,
so the tolerance is a couple of bf16 ulps (2^-8 relative each): the output is rounded once (LayerNorm) or
twice (RMSNorm rounds y to bf16 before the gain, as the model's code does), and under the CPU interpreter a
bf16 store truncates where torch and a GPU round to nearest.

Measured max |diff| on the CPU interpreter (output / d x / d weight / d bias), for these inputs:
fp32:  RMSNorm 9.5e-7 / 6.2e-7 / 1.5e-5; LayerNorm 7.2e-7 / 4.8e-7 / 3.1e-5 / 4.5e-6. d weight and d bias
       are sums over up to 130 rows and reach |170|, so those are ~1e-7 relative; every error is at most
       16% of its tolerance.
bf16:  RMSNorm 4.5e-2 / 7.7e-3 / 0.90; LayerNorm 3.0e-2 / 7.3e-3 / 0.42 / 5.4e-2 against the fp32
       reference, at most 46% of the tolerance (RMSNorm's twice-rounded output).
"""

import os

import pytest
import torch

from megatron_lite.kernels import layernorm, rmsnorm

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
# (4, 7, 33): 3 leading dims, odd width; (5, 777): wide odd rows, fewer rows than a tile; (130, 64): 130 rows
# is not a multiple of the 16-row tile; (1, 1, 1024): a single row.
SHAPES = [(4, 7, 33), (5, 777), (130, 64), (1, 1, 1024)]
# fp32: the same fp32 math up to summation order; bf16: a couple of ulps of the output's rounding (see above).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
EPS = 1e-5


def _inputs(shape, dtype, device, with_bias=True, weight_dtype=None, seed=0):
    """x (shape), weight and bias (N,) near 1 and 0 so that neither hides an error; x has a mean offset."""
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    weight = 1 + 0.3 * torch.randn(n, generator=gen)
    bias = 0.3 * torch.randn(n, generator=gen) if with_bias else None
    weight_dtype = weight_dtype or dtype
    return (
        x.to(device=device, dtype=dtype),
        weight.to(device=device, dtype=weight_dtype),
        None if bias is None else bias.to(device=device, dtype=weight_dtype),
    )


def _leaf(t, grad=True):
    return None if t is None else t.detach().clone().requires_grad_(grad)


def _check(triton_fn, reference_fn, inputs, function_name, dtype, seed=0):
    """Kernel on the inputs, reference on fp32 copies of them (for bf16, the fp32 math with no rounding);
    outputs and the gradients of every input that requires one must agree within TOL[dtype]."""
    ours = [_leaf(t) for t in inputs]
    refs = [None if t is None else _leaf(t.float()) for t in inputs]
    out = triton_fn(*ours)
    assert type(out.grad_fn).__name__ == f"{function_name}Backward", "the Triton path must have run"
    assert out.dtype == reference_fn(*inputs).dtype and out.shape == inputs[0].shape
    ref = reference_fn(*refs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)  # in the output's dtype
    out.backward(grad)
    ref.backward(grad.float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    for mine, theirs in zip(ours, refs):
        if theirs is not None:
            assert mine.grad.dtype == mine.dtype
            torch.testing.assert_close(mine.grad.float(), theirs.grad, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_reference(device, dtype, shape):
    x, weight, _ = _inputs(shape, dtype, device, with_bias=False)
    _check(
        lambda a, w: rmsnorm.rms_norm_triton(a, w, EPS),
        lambda a, w: rmsnorm.rms_norm_reference(a, w, EPS),
        [x, weight],
        "_RMSNorm",
        dtype,
    )


def _plain_rms_norm(x, weight, eps):
    """The reference's operations as autograd records them (before the reference had a backward of its own)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


@pytest.mark.parametrize(
    "x_dtype, w_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_rms_norm_reference_is_autograds_and_keeps_x_and_rstd(x_dtype, w_dtype):
    """The torch path's own backward gives autograd's gradients of its forward's operations bit for bit (input
    and weight, and the weight frozen), and saves x in its dtype, the weight and the fp32 1/rms: no fp32 copy of x
    and no normalised x, which autograd's graph kept."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 5, 96, generator=gen) * 2).to(x_dtype)
    w = (1 + torch.randn(96, generator=gen) / 4).to(w_dtype)
    g = torch.randn(4, 5, 96, generator=gen).to(torch.promote_types(x_dtype, w_dtype))
    for frozen in (False, True):
        xs, ws = (
            [x.clone().requires_grad_() for _ in range(2)],
            [w.clone().requires_grad_(not frozen) for _ in range(2)],
        )
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            ours = rmsnorm.rms_norm_reference(xs[0], ws[0], EPS)
        plain = _plain_rms_norm(xs[1], ws[1], EPS)
        assert torch.equal(ours, plain)
        ours.backward(g)
        plain.backward(g)
        assert torch.equal(xs[0].grad, xs[1].grad), (x_dtype, w_dtype, frozen)
        assert frozen or torch.equal(ws[0].grad, ws[1].grad), (x_dtype, w_dtype)
        assert [(t.dtype, t.shape) for t in saved] == [
            (x_dtype, x.shape),
            (w_dtype, w.shape),
            (torch.float32, (4, 5, 1)),
        ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_matches_reference(device, dtype, shape, with_bias):
    x, weight, bias = _inputs(shape, dtype, device, with_bias)
    _check(
        lambda a, w, b: layernorm.layer_norm_triton(a, w, b, EPS),
        lambda a, w, b: layernorm.layer_norm_reference(a, w, b, EPS),
        [x, weight, bias],
        "_LayerNorm",
        dtype,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_input_with_fp32_weight(device):
    """The reference's dtype rules: RMSNorm's `weight * y.to(x.dtype)` promotes to fp32, F.layer_norm keeps
    x's bf16; gradients come back in each input's own dtype."""
    x, weight, bias = _inputs((3, 50), torch.bfloat16, device, weight_dtype=torch.float32)
    _check(
        lambda a, w: rmsnorm.rms_norm_triton(a, w, EPS),
        lambda a, w: rmsnorm.rms_norm_reference(a, w, EPS),
        [x, weight],
        "_RMSNorm",
        torch.bfloat16,
    )
    assert rmsnorm.rms_norm_triton(x, weight, EPS).dtype == torch.float32
    if device == "cuda":  # torch's CUDA layer_norm refuses a bf16 input with an fp32 weight: no reference
        return
    _check(
        lambda a, w, b: layernorm.layer_norm_triton(a, w, b, EPS),
        lambda a, w, b: layernorm.layer_norm_reference(a, w, b, EPS),
        [x, weight, bias],
        "_LayerNorm",
        torch.bfloat16,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_weight_and_strided_input(device):
    """A weight that needs no gradient gets none (and its partial sums are skipped); x that is a transposed
    view (last dim strided) is copied to rows first and still matches."""
    x, weight, bias = _inputs((33, 6), torch.float32, device)
    x_t = x.t()  # (6, 33), last-dim stride 6
    assert x_t.stride(-1) != 1
    weight_t, bias_t = (torch.randn(33, generator=torch.Generator().manual_seed(1)).to(device) for _ in range(2))
    for fn, ref, extra in [
        (rmsnorm.rms_norm_triton, rmsnorm.rms_norm_reference, []),
        (layernorm.layer_norm_triton, layernorm.layer_norm_reference, [bias_t]),
    ]:
        ours, theirs = _leaf(x_t), _leaf(x_t)
        assert ours.stride(-1) != 1
        out, expected = fn(ours, weight_t, *extra, EPS), ref(theirs, weight_t, *extra, EPS)
        out.sum().backward()
        expected.sum().backward()
        assert weight_t.grad is None
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
        torch.testing.assert_close(ours.grad, theirs.grad, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_programs_loop_over_row_tiles(device, monkeypatch):
    """With more row tiles than backward programs, each program loops over several tiles and accumulates
    its d weight / d bias partials; shrink the cap so 130 rows (9 tiles of 16) loop over 4 programs."""
    monkeypatch.setattr(rmsnorm, "MAX_BWD_PROGRAMS", 4)
    monkeypatch.setattr(layernorm, "MAX_BWD_PROGRAMS", 4)
    x, weight, bias = _inputs((130, 64), torch.float32, device)
    _check(
        lambda a, w: rmsnorm.rms_norm_triton(a, w, EPS),
        lambda a, w: rmsnorm.rms_norm_reference(a, w, EPS),
        [x, weight],
        "_RMSNorm",
        torch.float32,
    )
    _check(
        lambda a, w, b: layernorm.layer_norm_triton(a, w, b, EPS),
        lambda a, w, b: layernorm.layer_norm_reference(a, w, b, EPS),
        [x, weight, bias],
        "_LayerNorm",
        torch.float32,
    )
