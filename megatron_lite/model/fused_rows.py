"""The fused projections' row layouts: one table that sharding, checkpoint conversion and HF import/export read.

  attn.qkv   rows = [q (n_heads * hd) | k (n_kv_heads * hd) | v (n_kv_heads * hd)]
  mlp.fc_in  rows = [gate (ffn) | up (ffn)] for SwiGLU, [fc (ffn)] for GeLU

A tensor-parallel rank holds the same slice of every segment ([q_r | k_r | v_r]), so a fused weight is split
segment by segment, never as one block (parallel/layers.py shard_segments). `universal_split_patterns` says the
same, and how every other parameter is split, in DeepSpeed's universal-checkpoint vocabulary, so its converter
can merge the TP shards of a checkpoint and its loader cut them for another tp.
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


def universal_split_patterns(model_cfg: ModelConfig, tp: int) -> dict:
    """How each tensor-parallel parameter was split, in DeepSpeed's universal-checkpoint vocabulary, so that
    its converter can merge TP shards and its loader can cut them for another tp (see parallel/layers.py).
    Recorded at tp=1 too: the loader cuts a tensor for a larger tp by what the conversion wrote beside it, and a
    tensor converted without its pattern is cut along dim 0 as one block (fused QKV, row-parallel, vocabulary
    all wrong, silently)."""
    from dataclasses import asdict

    from deepspeed.checkpoint.constants import (
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        PARAMETER_WITH_SUB_PARAMS,
        SUB_PARAM_SHARD_WIDTHS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        VOCABULARY_PARAMETER_PATTERNS,
    )
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    h = model_cfg.d_model
    # Fused tensors with more than one segment (GeLU's fc_in is one segment: a plain column split).
    segments = {
        r"blocks\.\d+\." + module.replace(".", r"\."): tuple(sizes)
        for module, sizes in fused_segments(model_cfg).items()
        if len(sizes) > 1
    }
    sub_params, widths = [], {}
    for prefix, sizes in segments.items():
        for kind in ("weight", "bias") if model_cfg.bias else ("weight",):
            shape = (sizes, h) if kind == "weight" else (sizes,)
            pattern = prefix + r"\." + kind
            sub_params.append(asdict(SubparamShape(patterns=[pattern], shape=shape, partition_dim=0)))
            widths[pattern] = [[size // tp] * tp for size in sizes]
    # DeepSpeed's converter refuses patterns that match nothing, so list only what this model has.
    replicated = [r".*norm.*"]
    replicated += [r"wpe\.weight"] if model_cfg.position == "learned" else []
    replicated += [r".*attn\.proj\.bias", r".*mlp\.fc_out\.bias"] if model_cfg.bias else []
    return {
        TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r".*attn\.proj\.weight", r".*mlp\.fc_out\.weight"],
        VOCABULARY_PARAMETER_PATTERNS: [r"wte\.weight"] + ([] if model_cfg.tie_embeddings else [r"lm_head\.weight"]),
        "original_vocab_size": model_cfg.vocab_size,  # padded rows are dropped and re-padded with zeros
        PARAMETER_WITH_SUB_PARAMS: sub_params,
        SUB_PARAM_SHARD_WIDTHS: widths,
    }
