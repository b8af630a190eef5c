"""Softmax cross entropy over the vocabulary in one pass, with the gradient written over the logits.

For logits z (N, V) and labels y, per token: loss = log sum_j exp(z_j) - z_y, computed stably as
m = max_j z_j, S = sum_j exp(z_j - m), loss = log S + m - z_y. Its gradient is
d loss / d z_j = softmax_j - [j == y] = exp(z_j - m) / S - [j == y].

Forward: one kernel reads the logits once (online max and rescaled sum-exp over vocabulary blocks, and one
gathered load of the target logit per row) and writes three (N,) vectors: m, S, z_y. On a vocabulary-parallel shard
(rank r holds ids [vocab_start, vocab_start + V/tp)) those are local; the ranks then combine them with three
(N,)-sized all-reduces: M = max over ranks of m, S = sum of S_r * exp(m_r - M), z_y = sum (only the owner
of y contributes). No rank ever holds full-vocabulary logits.

Backward: one kernel recomputes softmax from the saved logits, M and S and writes (softmax - onehot) times
the incoming gradient *into the logits' own buffer*, which is returned as the gradient. So backward needs no
second (N, V) buffer (torch's cross entropy keeps a log-softmax copy and allocates the gradient); the cost
is that the logits are consumed: nothing else may use them after this loss. Columns at or past `n_valid`
(vocabulary padding) are treated as -inf: no probability mass, zero gradient.

Memory traffic: forward reads N*V once; backward reads and writes N*V once. Left out on purpose:
ignore_index and label smoothing (the trainer uses neither), a fused LM-head matmul (the logits are one
GEMM's output; chunking it is a larger change than this kernel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl


def _tiling(device: torch.device) -> dict:
    """Rows per program and vocabulary columns per loop step. The interpreter wants few, large programs (each
    program costs Python work); a GPU wants many programs with a tile that fits in registers (2 x 2048
    fp32 values over 8 warps: 16 per thread)."""
    if device.type == "cuda":
        return dict(ROWS=2, BLOCK_V=2048, num_warps=8)
    return dict(ROWS=16, BLOCK_V=1024)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, n_valid: int | None = None) -> torch.Tensor:
    """Per-token loss (N,) in fp32 from logits (N, V) of which the first n_valid columns are real."""
    return F.cross_entropy(logits[:, :n_valid].float(), labels, reduction="none")


@triton.jit
def _forward_kernel(
    logits_ptr,
    labels_ptr,
    max_ptr,
    sumexp_ptr,
    target_ptr,
    n_rows,
    n_valid,
    stride,
    vocab_start,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,); int64: N * V may pass 2^31
    row_ok = rows < n_rows
    local_label = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start  # (ROWS,), may be off-shard
    # The label's logit: one gather per row, where this shard owns the label (a masked sum inside the loop would
    # add a third cross-warp reduction to every vocabulary block); 0 where another shard owns it.
    owned = row_ok & (local_label >= 0) & (local_label < n_valid)
    target = tl.load(logits_ptr + rows * stride + local_label, mask=owned, other=0.0).to(tl.float32)  # (ROWS,)
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        ok = row_ok[:, None] & (cols[None, :] < n_valid)  # (ROWS, BLOCK_V)
        z = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=1))  # (ROWS,)
        # Subtract 0 instead of -inf while a row has seen no logit (masked rows): exp(-inf - 0) = 0, no NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        # Rescale what was summed under the old max, add this block (masked columns are -inf: exp gives 0).
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(z - safe_max[:, None]), axis=1)
        running_max = new_max
    tl.store(max_ptr + rows, running_max, mask=row_ok)
    tl.store(sumexp_ptr + rows, running_sum, mask=row_ok)
    tl.store(target_ptr + rows, target, mask=row_ok)


@triton.jit
def _backward_kernel(
    logits_ptr,
    labels_ptr,
    max_ptr,
    sumexp_ptr,
    grad_loss_ptr,
    n_rows,
    n_cols,
    n_valid,
    stride,
    vocab_start,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    local_label = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start
    row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)  # (ROWS,) global max M
    grad_loss = tl.load(grad_loss_ptr + rows, mask=row_ok, other=0.0)
    scale = grad_loss / tl.load(sumexp_ptr + rows, mask=row_ok, other=1.0)  # g / S
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_row = row_ok[:, None] & (cols[None, :] < n_cols)
        ptrs = logits_ptr + rows[:, None] * stride + cols[None, :]
        z = tl.load(ptrs, mask=in_row, other=0.0).to(tl.float32)  # (ROWS, BLOCK_V)
        valid = cols[None, :] < n_valid
        grad = tl.where(valid, tl.exp(z - row_max[:, None]) * scale[:, None], 0.0)
        grad -= tl.where(valid & (cols[None, :] == local_label[:, None]), grad_loss[:, None], 0.0)
        tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, n_valid, vocab_start, tp_group):
        assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be (N, V) with contiguous rows"
        n_rows = logits.shape[0]
        labels = labels.contiguous()
        row_max, sum_exp, target = (torch.empty(n_rows, dtype=torch.float32, device=logits.device) for _ in range(3))
        tiling = _tiling(logits.device)
        _forward_kernel[(triton.cdiv(n_rows, tiling["ROWS"]),)](
            logits, labels, row_max, sum_exp, target, n_rows, n_valid, logits.stride(0), vocab_start, **tiling
        )
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            local_max = row_max.clone()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)  # M
            sum_exp *= torch.exp(local_max - row_max)  # this shard's sum, under the global max
            dist.all_reduce(sum_exp, group=tp_group)  # S
            dist.all_reduce(target, group=tp_group)  # z_y from the rank that owns y
        ctx.save_for_backward(logits, labels, row_max, sum_exp)
        ctx.n_valid, ctx.vocab_start = n_valid, vocab_start
        return torch.log(sum_exp) - (target - row_max)  # (N,) fp32; z_y - M first: both may be large

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, row_max, sum_exp = ctx.saved_tensors
        n_rows, n_cols = logits.shape
        tiling = _tiling(logits.device)
        _backward_kernel[(triton.cdiv(n_rows, tiling["ROWS"]),)](
            logits,
            labels,
            row_max,
            sum_exp,
            grad_loss.float().contiguous(),
            n_rows,
            n_cols,
            ctx.n_valid,
            logits.stride(0),
            ctx.vocab_start,
            **tiling,
        )
        return logits, None, None, None, None  # the logits buffer now holds their gradient


def cross_entropy_triton(
    logits: torch.Tensor, labels: torch.Tensor, n_valid: int | None = None, vocab_start: int = 0, tp_group=None
) -> torch.Tensor:
    """Per-token loss (N,) fp32. logits (N, V_local) hold vocabulary ids [vocab_start, vocab_start + V_local),
    of which the first n_valid columns are real (default: all); with tp_group, the shards of all TP ranks
    together make the vocabulary. Backward overwrites `logits` with their gradient."""
    n_valid = logits.shape[1] if n_valid is None else max(0, min(n_valid, logits.shape[1]))
    return _CrossEntropy.apply(logits, labels, n_valid, vocab_start, tp_group)
