"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4) over the last dim.

For a row x of N elements, gain w (N,) and g = d loss / d out:

    forward:   r = 1 / sqrt(mean_j x_j^2 + eps)          one fp32 scalar per row, saved for backward
               y = x * r,   out = w * round_x(y)         round_x: cast to x's dtype, as the model does
    backward:  dy = g * w
               dx = r * (dy - y * mean_j(dy_j * y_j))    (d r / d x_j = -r^3 x_j / N, and x r = y)
               dw = sum over all rows of g * round_x(y)

The output dtype is that of `w * y.to(x.dtype)` in the reference: bf16 x with an fp32 gain gives fp32.
All arithmetic is fp32. dw is reduced without atomics: each program accumulates the rows it owns in fp32
and writes one row of a (programs, N) buffer that torch sums over dim 0, so dw is the same on every run.
Only x, w and r (4 bytes per row) are saved; y is recomputed in backward.

Memory traffic (n rows, element size e): forward reads x once (nN e) and writes out once (nN e); backward
reads x and g and writes dx (3nN e), plus the (programs, N) fp32 partials. The torch reference writes and
re-reads x.float(), its square, y and y.to(x.dtype) as separate tensors and keeps some of them for backward.

x needs a unit stride in its last dim; leading dims are flattened by reshape, and a tensor whose last dim is
strided is copied with .contiguous() first (a norm's input is the residual stream, which never is).
Left out on purpose: rows wider than MAX_BLOCK_N (a whole row is one tile, so it is read once; wider rows
would need a two-pass loop), a fused residual add, and fp16 (the trainer runs fp32 or bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_lite.kernels.row_tiles import MAX_BWD_PROGRAMS, as_rows, row_tile


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's torch RMSNorm: weight * (x / rms(x)), computed in fp32 and rounded to x's dtype before the
    weight. Its backward is autograd's for those operations, bit for bit (tests/unit/test_kernels_norm.py), but
    it keeps x in its own dtype and the fp32 1/rms, as the Triton kernel does, where autograd's graph kept an fp32
    copy of x and the normalised x as well (plan/activations.py)."""
    return _RMSNormReference.apply(x, weight, eps)


class _RMSNormReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.float()
        y = x32 * rstd  # recomputed: the normalised input
        # autograd's steps for the forward's operations, in its order: weight * y_lp, the cast, x32 * rstd,
        # rsqrt, the mean and pow
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (g * y.to(x.dtype)).sum_to_size(weight.shape)
        d_y = (g * weight).to(x.dtype).float()  # autograd hands y_lp its gradient in y_lp's dtype
        d_x32 = d_y * rstd
        d_rstd = (d_y * x32).sum(-1, keepdim=True)
        d_mean = -0.5 * d_rstd * rstd.pow(3)
        d_square = d_mean.expand_as(x32) / x32.shape[-1]
        d_x32 = d_x32 + d_square * (2.0 * x32)
        return d_x32.to(x.dtype), d_weight, None


@triton.jit
def _forward_kernel(
    x_ptr, w_ptr, out_ptr, rstd_ptr, n_rows, n_cols, x_stride, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,); int64: row * stride may pass 2^31
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,) the whole row, padded to a power of two
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]  # (ROWS, BLOCK_N)
    # Padding loads as 0, so it adds nothing to the sum of squares; the mean divides by the true n_cols.
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,)
    # Round y to x's dtype before the gain, as the reference does (a no-op for fp32 x).
    y = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # (ROWS, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)  # (BLOCK_N,)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _backward_kernel(
    x_ptr,
    w_ptr,
    rstd_ptr,
    g_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    x_stride,
    g_stride,
    COMPUTE_DW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    dw = tl.zeros((BLOCK_N,), tl.float32)  # this program's share of dw, summed over its row tiles
    # Row tiles pid, pid + programs, ...: the grid is capped, so the partial buffer stays (<= 256, N).
    for tile in range(pid, tl.cdiv(n_rows, ROWS), n_programs):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * g_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)  # (ROWS,)
        y = x * rstd[:, None]  # (ROWS, BLOCK_N); 0 on padding, since x is
        dy = g * w[None, :]
        mean_dy_y = tl.sum(dy * y, axis=1) / n_cols  # (ROWS,)
        dx = rstd[:, None] * (dy - y * mean_dy_y[:, None])
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
        if COMPUTE_DW:  # the gain multiplied the rounded y in forward, so its gradient uses the rounded y
            y_rounded = y.to(x_ptr.dtype.element_ty).to(tl.float32)
            dw += tl.sum(g * y_rounded, axis=0)  # (BLOCK_N,); masked rows have g = 0
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_ok)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n_cols = x.shape[-1]
        assert weight.shape == (n_cols,), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
        x2d = as_rows(x)  # (n, N)
        n_rows = x2d.shape[0]
        rows, block_n, num_warps = row_tile(n_cols, "rms_norm_triton")
        out = torch.empty(n_rows, n_cols, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)  # (n,)
        weight = weight.contiguous()
        _forward_kernel[(max(1, triton.cdiv(n_rows, rows)),)](
            x2d, weight, out, rstd, n_rows, n_cols, x2d.stride(0), eps, ROWS=rows, BLOCK_N=block_n, num_warps=num_warps
        )
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        rows, block_n, num_warps = row_tile(n_cols, "rms_norm_triton")
        g2d = as_rows(grad_out)  # (n, N), in the output's dtype
        dx = torch.empty_like(x2d, memory_format=torch.contiguous_format)  # (n, N), x's dtype
        compute_dw = ctx.needs_input_grad[1]
        n_programs = max(1, min(triton.cdiv(n_rows, rows), MAX_BWD_PROGRAMS))
        # fp32 partial sums of dw, one row per program; a 1-element dummy when the gain needs no gradient
        dw_partial = torch.empty((n_programs, n_cols) if compute_dw else (1,), dtype=torch.float32, device=x2d.device)
        _backward_kernel[(n_programs,)](
            x2d,
            weight,
            rstd,
            g2d,
            dx,
            dw_partial,
            n_rows,
            n_cols,
            x2d.stride(0),
            g2d.stride(0),
            COMPUTE_DW=compute_dw,
            ROWS=rows,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
        dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
        return dx.view(ctx.x_shape), dw, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., N) with gain weight (N,), fp32 or bf16; the reference's output dtype. Backward gives
    dx and (when weight requires grad) a deterministic dweight."""
    return _RMSNorm.apply(x, weight, eps)
