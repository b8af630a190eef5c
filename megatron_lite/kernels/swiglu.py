"""SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer": FFN_SwiGLU, with Swish_1 = SiLU).

The MLP's first projection produces h = [gate | up] of shape (..., 2f) in one GEMM; with s = sigmoid(gate):

    forward:   out    = silu(gate) * up = gate * s * up                                  (..., f)
    backward:  d gate = g * up * s * (1 + gate * (1 - s))     (d silu/dx = s + x s (1 - s); 1 - s is
                                                              computed as sigmoid(-gate), see the kernel)
               d up   = g * silu(gate)

Both halves of the gradient are written into one (..., 2f) buffer laid out like h, so the gradient reaches
the fc_in GEMM without a torch.cat. Only h is saved; sigmoid is recomputed in backward (cheaper than
keeping silu(gate), which would be one more (..., f) activation per layer). All arithmetic is fp32; inputs
and outputs stay in h's dtype.

Memory traffic (e = element size, n = rows): forward reads 2nf e and writes nf e; backward reads 2nf e (h)
and nf e (g), and writes 2nf e: 8nf element moves in all. The unfused torch path (silu, mul; in backward
two muls, silu's backward and the cat of the chunk gradients) moves about 18nf; like this kernel, it saves only h
(its silu(gate) is recomputed in backward too).

h must have unit stride in its last dim (a GEMM output has); other leading dims are flattened with reshape,
which copies only when they cannot be viewed as rows. Left out on purpose: a fused fc_in GEMM (cuBLAS does
the matmul), an [up | gate] or interleaved layout, and other GLU variants (GeGLU, ReGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROWS = 32  # rows per program
BLOCK_F = 128  # columns per program; the tile (ROWS, BLOCK_F) is 4096 elements


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2f) = [gate | up] -> silu(gate) * up (..., f): the model's torch path. Its gradient is autograd's
    for those two ops, bit for bit, but it keeps only h, as the Triton kernel does, not also silu(gate): 3f per
    token with the product fc_out keeps, not 4f (plan/activations.py)."""
    return _SwiGLUReference.apply(h)


class _SwiGLUReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, -1)
        ctx.save_for_backward(h)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, -1)
        # what autograd runs for silu(gate) * up: mul's two gradients, silu's backward, the chunk's cat
        d_up = g * F.silu(gate)
        d_gate = torch.ops.aten.silu_backward(g * up, gate)
        return torch.cat([d_gate, d_up], -1)


@triton.jit
def _forward_kernel(h_ptr, out_ptr, n_rows, f, h_stride, out_stride, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,); int64: offsets may pass 2^31
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # (BLOCK_F,) within one half
    ok = (rows < n_rows)[:, None] & (cols < f)[None, :]  # (ROWS, BLOCK_F); f need not divide BLOCK_F
    gate_ptrs = h_ptr + rows[:, None] * h_stride + cols[None, :]
    gate = tl.load(gate_ptrs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + f, mask=ok, other=0.0).to(tl.float32)  # the up half starts f columns later
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _backward_kernel(h_ptr, g_ptr, dh_ptr, n_rows, f, h_stride, g_stride, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = (rows < n_rows)[:, None] & (cols < f)[None, :]
    h_offsets = rows[:, None] * h_stride + cols[None, :]  # (ROWS, BLOCK_F) gate entries of h
    gate = tl.load(h_ptr + h_offsets, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + h_offsets + f, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * g_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)  # recomputed rather than saved
    silu = gate * sig
    # 1 - s as sigmoid(-gate) rather than 1.0 - sig: for large gate, sig rounds to ~1 and the difference
    # loses its digits, which gate then multiplies (max error against fp64 roughly halves, 5.7e-6 -> 2.6e-6).
    d_gate = g * up * sig * (1.0 + gate * tl.sigmoid(-gate))
    d_up = g * silu
    dh_offsets = rows[:, None] * (2 * f) + cols[None, :]  # dh is a fresh contiguous (n, 2f)
    tl.store(dh_ptr + dh_offsets, d_gate.to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dh_ptr + dh_offsets + f, d_up.to(dh_ptr.dtype.element_ty), mask=ok)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit column stride; a view whenever the layout allows."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(n_rows: int, f: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, ROWS), triton.cdiv(f, BLOCK_F)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        assert h.shape[-1] % 2 == 0, f"h must hold [gate | up] in its last dim, got width {h.shape[-1]}"
        h2d = _as_rows(h)  # (n, 2f)
        n_rows, f = h2d.shape[0], h2d.shape[1] // 2
        out = torch.empty(n_rows, f, dtype=h.dtype, device=h.device)  # (n, f)
        _forward_kernel[_grid(n_rows, f)](h2d, out, n_rows, f, h2d.stride(0), out.stride(0), ROWS=ROWS, BLOCK_F=BLOCK_F)
        ctx.save_for_backward(h2d)
        ctx.shape = h.shape
        return out.view(*h.shape[:-1], f)

    @staticmethod
    def backward(ctx, grad_out):
        (h2d,) = ctx.saved_tensors
        n_rows, f = h2d.shape[0], h2d.shape[1] // 2
        g2d = _as_rows(grad_out)  # (n, f)
        dh = torch.empty_like(h2d, memory_format=torch.contiguous_format)  # (n, 2f): [d gate | d up]
        _backward_kernel[_grid(n_rows, f)](
            h2d, g2d, dh, n_rows, f, h2d.stride(0), g2d.stride(0), ROWS=ROWS, BLOCK_F=BLOCK_F
        )
        return dh.view(ctx.shape)


def swiglu_triton(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2f) = [gate | up] -> silu(gate) * up (..., f) in h's dtype; backward gives one (..., 2f) grad."""
    return _SwiGLU.apply(h)
