"""Tensor-parallel layers (Megatron's column/row split, vocab-parallel embedding), built by sharding full modules.

Each layer is made with `from_full(module, tp_group, ...)` from the serial module holding the full weights,
so a tp-sharded model initialised with seed s is the serial model initialised with seed s, sharded. One method
per layer, `shard_of(attr, full)`, says which part of a full parameter this rank holds; `from_full` uses it,
and so does building on the meta device (model/init.py), which draws each full tensor and keeps that part.
`from_full` on a meta module gives a meta layer. Fused projections keep their serial layout per shard: a
column-parallel weight made of segments (q|k|v, or gate|up) takes this rank's slice of every segment, so rank r
holds [q_r | k_r | v_r].

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

from megatron_lite.parallel import weight_grad
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


@torch.no_grad()
def _load_full(layer: nn.Module, full: nn.Module) -> nn.Module:
    """Fill each parameter of `layer` with its part (layer.shard_of) of the same-named parameter of `full`."""
    for attr, p in layer.named_parameters(recurse=False):
        p.copy_(layer.shard_of(attr, getattr(full, attr)))
    return layer


class _SequenceGatherLinear(torch.autograd.Function):
    """Column-parallel matmul on a sequence shard: all-gather the shard, multiply, and keep only the *shard*
    for backward, where it is gathered again (Korthikanti et al. 2022 §4.2.2). Saving the gathered input
    instead would cost tp times the memory that sequence parallelism is meant to save.

    Under a zero-bubble schedule (parallel/weight_grad.py) the weight gradients, gather included, wait for W."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, store, weights, after_b, fp8):
        """store, weights: a split step's WeightGradStore and the weight tensors that weight and bias stand in
        for (parallel/weight_grad.py); store None otherwise. after_b: a recomputed region's, handed over right
        after its B. fp8: the float8 matmul (parallel/fp8.py) under train.fp8."""
        ctx.group, ctx.store, ctx.weights, ctx.has_bias = group, store, weights, bias is not None
        ctx.after_b, ctx.param_dtype, ctx.fp8 = after_b, weight.dtype, fp8
        dtype = weight_grad.autocast_dtype(x_shard.device.type)
        if fp8 is not None:  # torchao casts the weight to float8 from the parameter itself
            x_shard = x_shard.to(dtype) if dtype is not None else x_shard
            ctx.save_for_backward(x_shard, weight)
            return fp8.forward(_all_gather(x_shard, SEQ_DIM, group), weight, bias)
        # Under bf16 autocast: the step's bf16 copies of the weights (weight_grad.weight_as), as autocast's
        # own linear would cast them; the gathered input is cast by autocast. Otherwise the weights themselves.
        weight, bias = weight_grad.weight_as(weight, dtype), weight_grad.weight_as(bias, dtype)
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather(x_shard, SEQ_DIM, group), weight, bias)  # (b, s, out/tp)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        has_bias = ctx.has_bias
        fp8 = ctx.fp8
        # Under bf16 autocast the forward multiplied in bf16 (grad_out's dtype) while x stayed fp32; backward
        # multiplies in the same dtype, as autocast's own linear would (autograd casts the results back to the
        # inputs' dtypes). In fp32, or with bf16 parameters, these casts do nothing. In float8: torchao's halves.
        grad_x = grad_out @ weight.to(grad_out.dtype) if fp8 is None else fp8.input_grad(grad_out, weight)

        def weight_grads():  # in the parameters' dtype (weight_grad.linear_weight_grads), or in float8
            x = _all_gather(x_shard.to(grad_out.dtype), SEQ_DIM, ctx.group)  # (b, s, in), gathered again
            if fp8 is not None:
                return fp8.weight_grads(grad_out, x, ctx.param_dtype, has_bias)
            return weight_grad.linear_weight_grads(grad_out, x, ctx.param_dtype, has_bias)

        grad_x = _reduce_scatter(grad_x, SEQ_DIM, ctx.group)
        if ctx.store is not None:
            ctx.store.defer(ctx.weights, weight_grads, ctx.after_b)
            return grad_x, None, None, None, None, None, None, None
        return grad_x, *weight_grads(), None, None, None, None, None


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W split by output rows. Input: replicated (or sequence shards with SP). fp8: its
    float8 matmul under train.fp8 (GPT.set_fp8), else None."""

    fp8 = None

    def __init__(
        self,
        in_features: int,
        segments: list[int],
        *,
        tp_group,
        bias: bool,
        sequence_parallel: bool,
        device=None,
        dtype=None,
    ):
        """segments: the full output rows of each fused part ([out_features] for a plain projection)."""
        super().__init__()
        _, size = _rank_size(tp_group)
        assert all(seg % size == 0 for seg in segments), f"segments {segments} do not split over {size} TP ranks"
        self.tp_group, self.sequence_parallel, self.segments = tp_group, sequence_parallel, list(segments)
        rows = sum(segments) // size
        self.weight = _mark_sharded(nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype)), 0)
        self.bias = _mark_sharded(nn.Parameter(torch.empty(rows, device=device, dtype=dtype)), 0) if bias else None

    def shard_of(self, attr: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full weight (out, in) or bias (out,): its slice of every segment."""
        return shard_segments(full, self.segments, 0, self.tp_group)

    @classmethod
    def from_full(
        cls, linear: nn.Linear, tp_group, *, segments: list[int] | None = None, sequence_parallel: bool = False
    ) -> ColumnParallelLinear:
        layer = cls(
            linear.in_features,
            segments or [linear.out_features],
            tp_group=tp_group,
            bias=linear.bias is not None,
            sequence_parallel=sequence_parallel,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        return _load_full(layer, linear)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to the caller (a kernel that fuses it, as bias-GeLU does)."""
        bias = self.bias if add_bias else None
        if self.sequence_parallel:  # x: (b, s/tp, h) sequence shard
            store = weight_grad.active_store()
            if store is None:
                return _SequenceGatherLinear.apply(x, self.weight, bias, self.tp_group, None, None, False, self.fp8)
            return _SequenceGatherLinear.apply(
                x,
                weight_grad.stand_in(self.weight),
                weight_grad.stand_in(bias),
                self.tp_group,
                store,
                (self.weight, bias),
                weight_grad.kept(),
                self.fp8,
            )
        return weight_grad.linear(copy_to_tp(x, self.tp_group), self.weight, bias, self.fp8)  # (b, s, out/tp)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W split by input columns. Output: replicated (or sequence shards). fp8: as
    ColumnParallelLinear's."""

    fp8 = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group,
        bias: bool,
        sequence_parallel: bool,
        device=None,
        dtype=None,
    ):
        """in_features: the full input width, split over the TP ranks."""
        super().__init__()
        _, size = _rank_size(tp_group)
        assert in_features % size == 0, f"{in_features} input features do not split over {size} TP ranks"
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        weight = torch.empty(out_features, in_features // size, device=device, dtype=dtype)
        self.weight = _mark_sharded(nn.Parameter(weight), 1)  # (out, in/tp)
        bias_full = torch.empty(out_features, device=device, dtype=dtype) if bias else None
        self.bias = nn.Parameter(bias_full) if bias else None  # replicated

    def shard_of(self, attr: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the full weight (out, in); the bias is replicated whole."""
        if attr == "bias":
            return full
        return shard_segments(full, [full.shape[1]], 1, self.tp_group)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_group, *, sequence_parallel: bool = False) -> RowParallelLinear:
        layer = cls(
            linear.in_features,
            linear.out_features,
            tp_group=tp_group,
            bias=linear.bias is not None,
            sequence_parallel=sequence_parallel,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        return _load_full(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = weight_grad.linear(x, self.weight, None, self.fp8)  # (b, s, out) partial sums
        bias = weight_grad.held(self.bias)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.tp_group)  # (b, s/tp, out)
            bias = copy_to_tp(bias, self.tp_group) if bias is not None else None
        else:
            y = reduce_from_tp(y, self.tp_group)
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its range and the partials are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, device=None, dtype=None):
        """num_embeddings: the full (padded) vocabulary, a multiple of the TP size."""
        super().__init__()
        rank, size = _rank_size(tp_group)
        assert num_embeddings % size == 0, f"{num_embeddings} embedding rows do not split over {size} TP ranks"
        rows = num_embeddings // size
        self.tp_group, self.vocab_start, self.vocab_rows = tp_group, rank * rows, rows
        weight = torch.empty(rows, embedding_dim, device=device, dtype=dtype)
        self.weight = _mark_sharded(nn.Parameter(weight), 0)  # (V_padded/tp, h)

    def shard_of(self, attr: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary range of the full (V_padded, h) weight."""
        return full[self.vocab_start : self.vocab_start + self.vocab_rows]  # not weight.shape: ZeRO-3 empties it

    @classmethod
    def from_full(cls, emb: nn.Embedding, tp_group) -> VocabParallelEmbedding:
        layer = cls(
            emb.num_embeddings, emb.embedding_dim, tp_group=tp_group, device=emb.weight.device, dtype=emb.weight.dtype
        )
        return _load_full(layer, emb)

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: a stand-in for self.weight (a pipeline's tied copy, see model/tied.py)."""
        weight = self.weight if weight is None else weight
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        out = weight_grad.embedding(local.masked_fill(outside, 0), weight)  # (b, s, h)
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


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, labels: torch.Tensor, vocab_start: int, tp_group
) -> torch.Tensor:
    """Per-token loss (N,) from logits_shard (N, V/tp) holding vocabulary ids [vocab_start, vocab_start + V/tp)."""
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, vocab_start, tp_group)
