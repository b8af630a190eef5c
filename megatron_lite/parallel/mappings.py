"""Every differentiable collective of tensor, sequence and context parallelism, and nothing else.

Megatron-LM (Shoeybi et al. 2019, §3) names the TP pair f (copy forward, all-reduce backward) and g
(all-reduce forward, identity backward); sequence parallelism (Korthikanti et al. 2022, §4.2.2) replaces g
by a reduce-scatter onto sequence shards and f by an all-gather from them, whose backward passes are each
other. Ulysses context parallelism (Jacobs et al. 2023) swaps sequence shards for head shards with an
all-to-all, whose backward is the reverse all-to-all. Every public wrapper says its pair in one line; each returns its input untouched on a one-rank group.

Layout: activations are (batch, seq, hidden), so the sequence dim is 1 and the hidden dim is -1. Buffers
are allocated on the input's device, so everything runs on CPU (gloo) as on GPU (NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1


def _size(group) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks into a new tensor: the input may be a caller's tensor (autograd hands the upstream
    gradient itself to backward), so reducing in place could corrupt it."""
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of x along dim."""
    n = _size(group)
    assert x.shape[dim] % n == 0, f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks"
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along dim (ranks in group order)."""
    n = _size(group)
    moved = x.movedim(dim, 0).contiguous()  # collectives concatenate on dim 0
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's chunk along dim."""
    n = _size(group)
    moved = x.movedim(dim, 0).contiguous()
    assert moved.shape[0] % n == 0, f"dim {dim} of size {moved.shape[0]} does not split over {n} ranks"
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Rank i sends its j-th chunk along scatter_dim to rank j and concatenates what it receives along
    gather_dim, in rank order."""
    n = _size(group)
    assert x.shape[scatter_dim] % n == 0, f"dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {n}"
    send = torch.stack(x.chunk(n, dim=scatter_dim))  # (n, ...): chunk j for rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity; backward: all-reduce over TP (Megatron's f)."""
    return x if group is None or _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce over TP; backward: identity (Megatron's g)."""
    return x if group is None or _size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim; backward: all-gather on the last dim."""
    return x if group is None or _size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather on the last dim; backward: keep this rank's chunk."""
    return x if group is None or _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the sequence dim; backward: all-gather on the sequence dim."""
    return x if group is None or _size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather on the sequence dim; backward: reduce-scatter on the sequence dim (SP's f)."""
    return x if group is None or _size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter on the sequence dim; backward: all-gather on the sequence dim (SP's g)."""
    return x if group is None or _size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Forward: split scatter_dim over the ranks, gather gather_dim from them; backward: the reverse."""
    return x if group is None or _size(group) == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)
