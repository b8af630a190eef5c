"""Apply tensor (and sequence) parallelism to a serial GPT: one table, applied in place, after init.

The model stays single-device code; this step swaps its modules for sharded ones made from the full
weights, so the sharded model is exactly the serial one split over ranks. On a meta model (model/build.py) it
makes meta shards, which materialisation then fills:

  attn.qkv   column-parallel, segments [q | k | v]     attn.proj   row-parallel
  mlp.fc_in  column-parallel, segments [gate | up]     mlp.fc_out  row-parallel
  wte        vocab-parallel embedding                  lm_head     vocab rows split (untied models)
  head       vocab-parallel cross entropy (no full-vocabulary logits on any rank)
  with SP:   to_blocks scatters the sequence; norms run on sequence shards with TP-summed gain gradients
  dropout:   attention dropout (heads split over TP) and, with SP, residual/embedding dropout (sequence
             split over TP) get this rank's tp_rank into their mask keys; replicated activations leave it
             out, so every TP rank draws their masks alike (parallel/random.py)

KV heads are split, never replicated: parallel.tp must divide model.n_kv_heads (validated in validation/parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_lite.kernels import ops
from megatron_lite.model.documents import DocumentMask, reduce_loss
from megatron_lite.model.fused_rows import fused_segments
from megatron_lite.model.gpt import GPT, LayerNorm, RMSNorm
from megatron_lite.parallel import weight_grad
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron_lite.parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp, scatter_to_sp


class ScatterToSP(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sp(x, self.tp_group)  # (b, s, h) -> (b, s/tp, h)


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence shard; gain/bias gradients are summed over TP by copy_to_tp's backward."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = copy_to_tp(weight_grad.held(self.bias), self.tp_group) if self.bias is not None else None
        weight = copy_to_tp(weight_grad.held(self.weight), self.tp_group)
        return ops.layer_norm(x, weight, bias, self.eps, self.kernel_backend)


class SequenceParallelRMSNorm(RMSNorm):
    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, copy_to_tp(weight_grad.held(self.weight), self.tp_group), self.eps, self.kernel_backend)


def _sequence_parallel_norm(norm: nn.Module, tp_group) -> nn.Module:
    """The same norm, taking over its parameters (real or meta), run on sequence shards."""
    with torch.device("meta"):
        if isinstance(norm, RMSNorm):
            new = SequenceParallelRMSNorm(norm.weight.shape[0], norm.eps)
        else:
            new = SequenceParallelLayerNorm(norm.normalized_shape, eps=norm.eps, bias=norm.bias is not None)
    new.load_state_dict(norm.state_dict(keep_vars=True), assign=True)
    new.tp_group = tp_group
    return new


class VocabParallelHead(nn.Module):
    """Local logits for this rank's vocabulary range, then vocab-parallel cross entropy."""

    kernel_op = "cross_entropy"
    kernel_backend = "torch"

    def __init__(self, vocab_size: int, vocab_start: int, tp_group, sequence_parallel: bool):
        super().__init__()
        self.vocab_size, self.vocab_start = vocab_size, vocab_start
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
    ) -> torch.Tensor:
        h = gather_from_sp(h, self.tp_group) if self.sequence_parallel else copy_to_tp(h, self.tp_group)
        logits = weight_grad.head_linear(h, weight)  # (b, s, V_padded/tp)
        valid = self.vocab_size - self.vocab_start  # ids at or past the true vocabulary are padding
        if labels is not None and self.kernel_backend == "triton":  # the kernel skips padded columns itself
            from megatron_lite.kernels.cross_entropy import cross_entropy_triton  # imports Triton

            losses = cross_entropy_triton(
                logits.flatten(0, 1), labels.flatten(), valid, self.vocab_start, self.tp_group
            )
            return reduce_loss(losses, docs)
        if valid < logits.shape[-1]:
            padded = torch.arange(logits.shape[-1], device=logits.device) >= valid
            logits = logits.masked_fill(padded, float("-inf"))
        if labels is None:
            return gather_from_tp(logits, self.tp_group)[..., : self.vocab_size]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.vocab_start, self.tp_group)
        return reduce_loss(losses, docs)


def parallelize(model: GPT, tp_group, sequence_parallel: bool = False) -> GPT:
    """Shard `model` in place over tp_group (a no-op for one rank) and return it."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp == 1:
        return model
    tp_rank = dist.get_rank(tp_group)
    cfg = model.cfg
    plan = {  # submodule name -> (layer, fused segments of its output rows)
        "attn.qkv": (ColumnParallelLinear, fused_segments(cfg)["attn.qkv"]),
        "attn.proj": (RowParallelLinear, None),
        "mlp.fc_in": (ColumnParallelLinear, fused_segments(cfg)["mlp.fc_in"]),
        "mlp.fc_out": (RowParallelLinear, None),
    }
    for block in model.blocks:
        for name, (layer, segments) in plan.items():
            parent, attr = block.get_submodule(name.split(".")[0]), name.split(".")[1]
            full = getattr(parent, attr)
            kwargs = {"segments": segments} if segments else {}
            setattr(parent, attr, layer.from_full(full, tp_group, sequence_parallel=sequence_parallel, **kwargs))
        block.attn.tp_rank = tp_rank  # heads are split: each rank masks its own attention probabilities
        if sequence_parallel:
            block.norm1 = _sequence_parallel_norm(block.norm1, tp_group)
            block.norm2 = _sequence_parallel_norm(block.norm2, tp_group)
            block.drop.tp_rank = tp_rank  # residual branches on sequence shards
    # A pipeline rank may hold neither the embedding nor the final norm (GPT.keep_chunks set them to None).
    if sequence_parallel:
        if model.norm_f is not None:
            model.norm_f = _sequence_parallel_norm(model.norm_f, tp_group)
        model.to_blocks = ScatterToSP(tp_group)
        model.drop.tp_rank = tp_rank  # the embedding output is scattered before its dropout
    if model.wte is not None:
        model.wte = VocabParallelEmbedding.from_full(model.wte, tp_group)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear.from_full(model.lm_head, tp_group)
    vocab_start = tp_rank * (model.padded_vocab // tp)
    model.head = VocabParallelHead(cfg.vocab_size, vocab_start, tp_group, sequence_parallel)
    return model
