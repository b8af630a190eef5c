"""Rotary position embedding (RoPE; Su et al. 2021, RoFormer, in its elementwise cos/sin form), in the
rotate-half layout of HF Llama.

For a head vector x of width hd, split into halves x1 = x[:hd/2], x2 = x[hd/2:], and the angles of its
position p (cos, sin tables of shape (s, hd) with both halves equal, as `rope_cos_sin` builds them):

    forward:   y1 = x1 * cos - x2 * sin          y2 = x2 * cos + x1 * sin

a rotation of each pair (x1[i], x2[i]) by the angle p * theta_i. Its Jacobian is orthogonal, so the
backward pass is the rotation by the opposite angle (sin -> -sin):

    backward:  dx1 = g1 * cos + g2 * sin         dx2 = g2 * cos - g1 * sin

The same kernel does both, with SIGN = +1 (forward) or -1 (backward). Only the first half of each table is
read (the halves are equal); a table whose halves differ would give wrong results here.

Strides: q and k arrive as transposed views (b, heads, s, hd) of the (b, s, heads, hd) projection, so the
kernel takes all four strides of its input and of its output and never calls .contiguous(): a copy would
cost one more read and write of the tensor. The output is `torch.empty_like(x)`, which keeps x's layout when
x is dense (as the reference's `x.float() * cos` does) and is contiguous otherwise.

Memory traffic: forward reads x and writes y once (2 * numel * itemsize); backward reads the gradient and
writes dx once. The (s, hd/2) tables are shared by every batch and head, so they stay in cache.

Position ids: given positions (b, s), token t of sample b takes the table row positions[b, t] instead of row t
(data.document_mask counts positions from each document's start); the tables then cover model.seq_len rows.

Left out on purpose: cos/sin gradients (fixed tables), the interleaved-pairs layout (GPT-J, the RoFormer paper),
partial rotation of only some head dims, and fusing q and k into one launch (two launches, each one pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements (rows x half-width) per program: large tiles keep the interpreter fast


def apply_rope_reference(x, cos, sin, positions=None):
    """x: (b, heads, s, hd); rotate pairs (i, i + hd/2) by the position angle: of row t of the (s, hd) tables, or
    of row positions[b, t] given positions (b, s)."""
    if positions is not None:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (b, 1, s, hd)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@triton.jit
def _rope_kernel(
    x_ptr,
    y_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    n_rows,
    n_heads,
    seq_len,
    half,
    xs_b,
    xs_h,
    xs_s,
    xs_d,
    ys_b,
    ys_h,
    ys_s,
    ys_d,
    table_stride,
    SIGN: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # (ROWS,) flat (b, heads, s) index; int64 so that row * stride cannot overflow past 2^31 elements
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,) index into one half of the head dim
    pos = rows % seq_len  # (ROWS,) position: selects the row of the tables
    head = (rows // seq_len) % n_heads
    batch = rows // (seq_len * n_heads)
    ok = (rows < n_rows)[:, None] & (cols < half)[None, :]  # (ROWS, BLOCK_HALF); hd/2 need not be a power of 2

    x_row = batch * xs_b + head * xs_h + pos * xs_s  # (ROWS,) element offsets of each row's start
    x1 = tl.load(x_ptr + x_row[:, None] + cols[None, :] * xs_d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row[:, None] + (cols[None, :] + half) * xs_d, mask=ok, other=0.0).to(tl.float32)
    if HAS_POSITIONS:  # (b, s) position ids, contiguous: the table row of each token
        row_of = tl.load(pos_ptr + batch * seq_len + pos, mask=rows < n_rows, other=0).to(tl.int64)
    else:
        row_of = pos
    table = row_of[:, None] * table_stride + cols[None, :]  # (ROWS, BLOCK_HALF); first half of each table row
    c = tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32) * SIGN  # backward rotates by -angle

    y_row = batch * ys_b + head * ys_h + pos * ys_s
    y_ty = y_ptr.dtype.element_ty  # fp32 math, one rounding to the input dtype (as the reference)
    tl.store(y_ptr + y_row[:, None] + cols[None, :] * ys_d, (x1 * c - x2 * s).to(y_ty), mask=ok)
    tl.store(y_ptr + y_row[:, None] + (cols[None, :] + half) * ys_d, (x2 * c + x1 * s).to(y_ty), mask=ok)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int, positions=None) -> torch.Tensor:
    """Launch one pass over x (b, heads, s, hd) of any strides; returns y in x's dtype (and layout if dense)."""
    b, n_heads, seq_len, hd = x.shape
    assert hd % 2 == 0, f"RoPE needs an even head dim, got {hd}"
    if positions is None:
        assert cos.shape == sin.shape == (seq_len, hd), f"tables {tuple(cos.shape)} do not match x {tuple(x.shape)}"
    else:
        assert positions.shape == (b, seq_len) and positions.is_contiguous(), (tuple(positions.shape), tuple(x.shape))
        assert cos.shape == sin.shape and cos.shape[1] == hd, f"tables {tuple(cos.shape)} do not match x {x.shape}"
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, "cos/sin must share a row-major layout"
    y = torch.empty_like(x)
    n_rows, half = b * n_heads * seq_len, hd // 2
    block_half = triton.next_power_of_2(half)
    rows_per_program = max(1, TILE // block_half)  # a power of two, as tl.arange needs
    _rope_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x,
        y,
        cos,
        sin,
        positions if positions is not None else cos,  # (unread without positions)
        n_rows,
        n_heads,
        seq_len,
        half,
        *x.stride(),
        *y.stride(),
        cos.stride(0),
        SIGN=sign,
        HAS_POSITIONS=positions is not None,
        ROWS=rows_per_program,
        BLOCK_HALF=block_half,
    )
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions):
        ctx.save_for_backward(cos, sin, positions)  # the tables (and ids) only: the backward does not need x
        return _rotate(x, cos, sin, 1, positions)

    @staticmethod
    def backward(ctx, grad_y):
        cos, sin, positions = ctx.saved_tensors
        return _rotate(grad_y, cos, sin, -1, positions), None, None, None


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions=None) -> torch.Tensor:
    """x (b, heads, s, hd), any strides, rotated by the (s, hd) cos/sin tables (halves equal), row t or, given
    positions (b, s), row positions[b, t] for token t of sample b; no table grads."""
    return _RoPE.apply(x, cos, sin, None if positions is None else positions.contiguous())
