"""The fused projections' row layouts: one table that sharding, checkpoint conversion and HF import/export read.

  attn.qkv   rows = [q (n_heads * hd) | k (n_kv_heads * hd) | v (n_kv_heads * hd)]
  mlp.fc_in  rows = [gate (ffn) | up (ffn)] for SwiGLU, [fc (ffn)] for GeLU

A tensor-parallel rank holds the same slice of every segment ([q_r | k_r | v_r]), so a fused weight is split
segment by segment, never as one block (parallel/layers.py shard_segments). engine/ds_config.py's
`universal_split_patterns` says the same, and how every other parameter is split, in DeepSpeed's
universal-checkpoint vocabulary, so its converter can merge the TP shards of a checkpoint and its loader cut them
for another tp.
"""

from __future__ import annotations

from megatron_lite.config import ModelConfig


def fused_segments(cfg: ModelConfig) -> dict[str, list[int]]:
    """Module name inside a block -> the row sizes of its fused output segments."""
    kv = cfg.kv_heads * cfg.head_dim
    return {
        "attn.qkv": [cfg.n_heads * cfg.head_dim, kv, kv],
        "mlp.fc_in": [cfg.ffn] * (2 if cfg.activation == "swiglu" else 1),
    }


def segments_of(name: str, cfg: ModelConfig) -> list[int] | None:
    """The fused segments of parameter `name` (e.g. blocks.3.attn.qkv.bias), None if it is not fused."""
    for module, sizes in fused_segments(cfg).items():
        if f".{module}." in f".{name}":
            return sizes
    return None
