"""LayerNorm (Ba, Kiros & Hinton 2016, "Layer Normalization", eq. 4) over the last dim, with gain and
optional bias.

For a row x of N elements, gain w (N,), bias b (N,) and g = d loss / d out:

    forward:   mu = mean_j x_j,   r = 1 / sqrt(mean_j (x_j - mu)^2 + eps)     fp32 per row, both saved
               xhat = (x - mu) * r,   out = w * xhat + b
    backward:  dxhat = g * w
               dx = r * (dxhat - mean_j dxhat_j - xhat * mean_j(dxhat_j * xhat_j))
               dw = sum over all rows of g * xhat,   db = sum over all rows of g

The variance is taken of the centred row (two passes over the tile held in registers), not as
E[x^2] - mu^2, which cancels badly when |mu| is large against the spread. All arithmetic is fp32 and the
output has x's dtype, as F.layer_norm's. dw and db are reduced without atomics: each program accumulates the
rows it owns in fp32 and writes one row of a (programs, N) buffer that torch sums over dim 0, so both are
the same on every run. Saved for backward: x, w, b and mu, r (8 bytes per row); xhat is recomputed.

Memory traffic (n rows, element size e): forward reads x once and writes out once (2nN e); backward reads x
and g and writes dx (3nN e), plus two (programs, N) fp32 partial buffers.

x needs a unit stride in its last dim; leading dims are flattened by reshape, and a tensor whose last dim is
strided is copied with .contiguous() first. Left out on purpose: rows wider than MAX_BLOCK_N (a whole row
is one tile so it is read once), a missing gain (every LayerNorm in the model has one), a fused residual add
or dropout, and fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_lite.kernels.row_tiles import MAX_BWD_PROGRAMS, as_rows, row_tile


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The model's torch LayerNorm over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@triton.jit
def _forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    mean_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    x_stride,
    eps,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,); int64: row * stride may pass 2^31
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,) the whole row, padded to a power of two
    col_ok = cols < n_cols
    ok = (rows < n_rows)[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols  # (ROWS,); padding is 0 and the divisor is the true width
    xc = tl.where(ok, x - mean[:, None], 0.0)  # (ROWS, BLOCK_N); re-zero the padding, which x - mu is not
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)  # (ROWS,)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    out = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(mean_ptr + rows, mean, mask=rows < n_rows)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _backward_kernel(
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    g_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    n_rows,
    n_cols,
    x_stride,
    g_stride,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    dw = tl.zeros((BLOCK_N,), tl.float32)  # this program's shares of dw and db over its row tiles
    db = tl.zeros((BLOCK_N,), tl.float32)
    # Row tiles pid, pid + programs, ...: the grid is capped, so the partial buffers stay (<= 256, N).
    for tile in range(pid, tl.cdiv(n_rows, ROWS), n_programs):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * g_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)  # (ROWS,)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)  # (ROWS, BLOCK_N); 0 on padding
        dxhat = g * w[None, :]  # 0 on padding, since g is
        mean_dxhat = tl.sum(dxhat, axis=1) / n_cols  # (ROWS,)
        mean_dxhat_xhat = tl.sum(dxhat * xhat, axis=1) / n_cols  # (ROWS,)
        dx = rstd[:, None] * (dxhat - mean_dxhat[:, None] - xhat * mean_dxhat_xhat[:, None])
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
        if COMPUTE_DW:
            dw += tl.sum(g * xhat, axis=0)  # (BLOCK_N,)
        if COMPUTE_DB:
            db += tl.sum(g, axis=0)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_ok)
    if COMPUTE_DB:
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=col_ok)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        n_cols = x.shape[-1]
        assert weight.shape == (n_cols,), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
        assert bias is None or bias.shape == (n_cols,), f"bias {tuple(bias.shape)} does not match x {tuple(x.shape)}"
        x2d = as_rows(x)  # (n, N)
        n_rows = x2d.shape[0]
        rows, block_n, num_warps = row_tile(n_cols, "layer_norm_triton")
        out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)  # (n, N)
        mean, rstd = (torch.empty(n_rows, dtype=torch.float32, device=x.device) for _ in range(2))  # (n,) each
        weight = weight.contiguous()
        b = bias.contiguous() if bias is not None else weight  # a dummy pointer when there is no bias; never read
        _forward_kernel[(max(1, triton.cdiv(n_rows, rows)),)](
            x2d,
            weight,
            b,
            out,
            mean,
            rstd,
            n_rows,
            n_cols,
            x2d.stride(0),
            eps,
            HAS_BIAS=bias is not None,
            ROWS=rows,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        rows, block_n, num_warps = row_tile(n_cols, "layer_norm_triton")
        g2d = as_rows(grad_out)  # (n, N)
        dx = torch.empty(n_rows, n_cols, dtype=x2d.dtype, device=x2d.device)
        compute_dw = ctx.needs_input_grad[1]
        compute_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        n_programs = max(1, min(triton.cdiv(n_rows, rows), MAX_BWD_PROGRAMS))

        def partial(needed: bool) -> torch.Tensor:  # (programs, N) fp32, or a 1-element dummy never written
            return torch.empty((n_programs, n_cols) if needed else (1,), dtype=torch.float32, device=x2d.device)

        dw_partial, db_partial = partial(compute_dw), partial(compute_db)
        _backward_kernel[(n_programs,)](
            x2d,
            weight,
            mean,
            rstd,
            g2d,
            dx,
            dw_partial,
            db_partial,
            n_rows,
            n_cols,
            x2d.stride(0),
            g2d.stride(0),
            COMPUTE_DW=compute_dw,
            COMPUTE_DB=compute_db,
            ROWS=rows,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
        dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
        db = db_partial.sum(0).to(ctx.bias_dtype) if compute_db else None
        return dx.view(ctx.x_shape), dw, db, None


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of x (..., N) with gain weight (N,) and bias (N,) or None; output in x's dtype. Backward gives
    dx, dweight and dbias (deterministic; each only when required)."""
    return _LayerNorm.apply(x, weight, bias, eps)
