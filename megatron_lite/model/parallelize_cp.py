"""Apply context parallelism to a GPT: each sequence split over the cp ranks of a replica, in place.

The model stays single-device code with three hooks that this step fills:

  model.sequence        a CPSequence: this rank keeps chunks r and 2cp-1-r of the 2cp equal chunks of every
                        sequence (tokens and labels), with their global position ids (learned positions, RoPE
                        rows), and its loss is its share of the sequence's mean
  attn.cp_attention     ring or Ulysses attention (parallel/context_parallel.py) around the block's own SDPA
  dropout keys          every activation is a cp shard, so residual and embedding masks put the cp rank in
                        their key; Ulysses' core holds a share of the heads, so its masks do too; ring attention
                        keys its masks by the global pair of chunks (and the tile of query rows) it multiplies

Nothing else changes: every weight is replicated over cp (DeepSpeed reduces its gradient over dp x cp, see
parallel/context.py), norms and MLPs work token by token, and tensor and sequence parallelism apply to this
rank's shard as they would to a shorter sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.model.gpt import GPT, Attention
from megatron_lite.parallel.context_parallel import cp_positions, ring_attention, shard_sequence, ulysses_attention
from megatron_lite.parallel.random import Key


class CPSequence:
    """This rank's shard of every sequence: chunks r and 2cp-1-r (equal causal work on every rank)."""

    def __init__(self, cp_size: int, cp_rank: int):
        self.size, self.rank = cp_size, cp_rank

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, 1, self.size, self.rank)  # (b, s) -> (b, s/cp)

    def positions(self, s_local: int, device) -> torch.Tensor:
        return cp_positions(s_local * self.size, self.size, self.rank, device)

    def rows(self, table: torch.Tensor, s_local: int) -> torch.Tensor:
        return table[self.positions(s_local, table.device)]


class RingAttention:
    """attn.cp_attention for cp_mode=ring: K/V blocks pass around the cp group, partial outputs merge by
    log-sum-exp; dropout masks are keyed by (step, micro-batch, layer, chunk pair, tile), see ring_attention."""

    def __init__(self, cp_group):
        self.cp_group = cp_group

    def __call__(self, attn: Attention, q, k, v, key: Key, docs=None) -> torch.Tensor:
        p = attn.dropout if attn.training else 0.0
        segments = None if docs is None else docs.segments  # the whole window's: each block takes its own
        return ring_attention(
            q, k, v, self.cp_group, dropout_p=p, mask_key=(*key, "attn_probs"), tp_rank=attn.tp_rank, segments=segments
        )


class UlyssesAttention:
    """attn.cp_attention for cp_mode=ulysses: all-to-all to head shards of the whole sequence, the block's own
    SDPA (flash attention on a GPU, keyed dropout with this cp rank), all-to-all back."""

    def __init__(self, cp_group):
        self.cp_group = cp_group

    def __call__(self, attn: Attention, q, k, v, key: Key, docs=None) -> torch.Tensor:
        # docs hold the whole window's segments, as the gathered sequence is whole
        return ulysses_attention(q, k, v, self.cp_group, lambda q_, k_, v_: attn.sdpa(q_, k_, v_, key, docs))


def cp_parallelize(model: GPT, cp_group, mode: str) -> GPT:
    """Split `model`'s sequences over cp_group (a no-op for one rank) and return it. Works on a meta model,
    a built one and a pipeline chunk alike: it touches no parameter."""
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    if cp == 1:
        return model
    assert mode in ("ring", "ulysses"), mode
    cp_rank = dist.get_rank(cp_group)
    model.sequence = CPSequence(cp, cp_rank)
    model.drop.cp_rank = cp_rank
    attention = RingAttention(cp_group) if mode == "ring" else UlyssesAttention(cp_group)
    for block in model.blocks:
        block.drop.cp_rank = cp_rank
        block.attn.cp_attention = attention
        block.attn.cp_rank = cp_rank if mode == "ulysses" else None
    return model
