"""Tensor-parallel layers (Megatron's column/row split, vocab-parallel embedding), built by sharding full modules.

Each layer is made with `from_full(module, tp_group, ...)` from the serial module holding the full weights,
so a tp-sharded model initialised with seed s is the serial model initialised with seed s, sharded.
Fused projections keep their serial layout per shard: a column-parallel weight made of segments (q|k|v, or
gate|up) takes this rank's slice of every segment, so rank r holds [q_r | k_r | v_r].

Sharded parameters carry `tensor_model_parallel = True` (and `partition_dim`), which DeepSpeed reads so that
gradient-norm clipping counts TP-replicated parameters once. With sequence parallelism, parameters that see
only a sequence shard on each rank (norm gains, row-parallel biases) are used through `copy_to_tp`, whose
backward sums their gradients over TP inside autograd — so ZeRO's gradient hooks see complete gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_lite.parallel.mappings import (
    SEQ_DIM,
    _all_gather,
    _reduce_scatter,
    copy_to_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def shard_segments(full: torch.Tensor, segments: list[int], dim: int, group) -> torch.Tensor:
    """This rank's slice of each segment of `full` along dim, concatenated (segments must divide by tp)."""
    rank, size = _rank_size(group)
    parts = full.split(segments, dim=dim)
    for seg in segments:
        assert seg % size == 0, f"segment {seg} does not split over {size} TP ranks"
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in parts], dim=dim).contiguous()


def _mark_sharded(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


class _SequenceGatherLinear(torch.autograd.Function):
    """Column-parallel matmul on a sequence shard: all-gather the shard, multiply, and keep only the *shard*
    for backward, where it is gathered again (Korthikanti et al. 2022 §4.2.2). Saving the gathered input
    instead would cost tp times the memory that sequence parallelism is meant to save."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather(x_shard, SEQ_DIM, group), weight, bias)  # (b, s, out/tp)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        x = _all_gather(x_shard, SEQ_DIM, ctx.group)  # (b, s, in), gathered again
        grad_x = grad_out @ weight
        grad_w = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)
        grad_b = grad_out.flatten(0, -2).sum(0) if ctx.has_bias else None
        return _reduce_scatter(grad_x, SEQ_DIM, ctx.group), grad_w, grad_b, None


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W split by output rows. Input: replicated (or sequence shards with SP)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, tp_group, sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = _mark_sharded(nn.Parameter(weight), 0)  # (out/tp, in)
        self.bias = _mark_sharded(nn.Parameter(bias), 0) if bias is not None else None

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_group, *, segments: list[int] | None = None,
                  sequence_parallel: bool = False) -> "ColumnParallelLinear":
        segments = segments or [linear.out_features]
        w = shard_segments(linear.weight.data, segments, 0, tp_group)
        b = shard_segments(linear.bias.data, segments, 0, tp_group) if linear.bias is not None else None
        return cls(w, b, tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to the caller (a kernel that fuses it, as bias-GeLU does)."""
        bias = self.bias if add_bias else None
        if self.sequence_parallel:  # x: (b, s/tp, h) sequence shard
            return _SequenceGatherLinear.apply(x, self.weight, bias, self.tp_group)
        return F.linear(copy_to_tp(x, self.tp_group), self.weight, bias)  # (b, s, out/tp)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W split by input columns. Output: replicated (or sequence shards)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, tp_group, sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = _mark_sharded(nn.Parameter(weight), 1)  # (out, in/tp)
        self.bias = nn.Parameter(bias) if bias is not None else None  # replicated

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_group, *, sequence_parallel: bool = False) -> "RowParallelLinear":
        w = shard_segments(linear.weight.data, [linear.in_features], 1, tp_group)
        b = linear.bias.data.clone() if linear.bias is not None else None
        return cls(w, b, tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (b, s, out) partial sums
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.tp_group)  # (b, s/tp, out)
            bias = copy_to_tp(self.bias, self.tp_group) if self.bias is not None else None
        else:
            y = reduce_from_tp(y, self.tp_group)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its range and the partials are summed."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, *, tp_group):
        super().__init__()
        self.tp_group, self.vocab_start = tp_group, vocab_start
        self.weight = _mark_sharded(nn.Parameter(weight), 0)  # (V_padded/tp, h)

    @classmethod
    def from_full(cls, emb: nn.Embedding, tp_group) -> "VocabParallelEmbedding":
        rank, size = _rank_size(tp_group)
        rows = emb.num_embeddings // size
        return cls(emb.weight.data[rank * rows:(rank + 1) * rows].clone(), rank * rows, tp_group=tp_group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocabulary shards without gathering the full logits (Megatron §3).

    Each rank holds logits for its vocabulary range; only three (N,)-sized all-reduces cross ranks: the
    max (for stability), the target logit, and the sum of exponentials.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        logits = logits.float()  # (N, V/tp)
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local = labels - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target, group=group)
        exp = shifted.exp_()  # reuse the buffer: shifted is not needed any more
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], local[mine]] -= 1.0
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 tp_group) -> torch.Tensor:
    """Per-token loss (N,) from logits_shard (N, V/tp) holding vocabulary ids [vocab_start, vocab_start + V/tp)."""
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, vocab_start, tp_group)
