"""The parameters one rank holds, in the order its model registers them: a pure function of the model shape
and the layout, equal to what model/build.py materialises (tests/unit/test_plan.py builds the model on the meta
device and compares name by name).

Tensor parallelism splits qkv and fc_in by output rows, proj and fc_out by input columns, the embedding and an
untied head by (padded) vocabulary rows; norms, the position embedding and row-parallel biases are whole on
every TP rank. A pipeline rank holds its chunks' blocks, the embedding on virtual stage 0, the final norm and
the head on the last one; a tied head on its own stage keeps a copy of the embedding (model/tied.py).
Context parallelism replicates every parameter. AdamW's two groups follow engine/ds_config.param_groups:
matrices decay, vectors do not.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from megatron_lite.config import ModelConfig
from megatron_lite.pipeline.partition import rank_chunks


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    decay: bool  # a matrix (AdamW weight decay), else a vector


class Params(tuple):
    """A rank's parameters, a tuple of Param that hashes once. The planner's caches (states.zero_states,
    chunk_param_count) take it as a key, and a tuple rehashes every item on each lookup: for the 1008B model
    that was 111 million dataclass hashes, most of a layout search's time."""

    def __hash__(self) -> int:
        if "_hash" not in self.__dict__:
            self._hash = tuple.__hash__(self)
        return self._hash

    @functools.cached_property
    def numel(self) -> int:
        """Their elements, summed once."""
        return sum(p.numel for p in self)


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """Embedding rows: the vocabulary padded to a multiple of vocab_multiple * tp (model/gpt.py)."""
    multiple = cfg.vocab_multiple * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def _norm(prefix: str, cfg: ModelConfig) -> list[Param]:
    out = [Param(f"{prefix}.weight", cfg.d_model, False)]
    if cfg.norm == "layernorm" and cfg.bias:
        out.append(Param(f"{prefix}.bias", cfg.d_model, False))
    return out


def _linear(prefix: str, rows: int, cols: int, bias_rows: int | None) -> list[Param]:
    out = [Param(f"{prefix}.weight", rows * cols, True)]
    if bias_rows is not None:
        out.append(Param(f"{prefix}.bias", bias_rows, False))
    return out


def block_linears(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """One block's four projections on one TP rank: name -> (rows, cols) of the weight, i.e. (out, in) features."""
    h, d, f = cfg.d_model, cfg.head_dim, cfg.ffn
    return {
        "attn.qkv": ((cfg.n_heads + 2 * cfg.kv_heads) * d // tp, h),
        "attn.proj": (h, cfg.n_heads * d // tp),
        "mlp.fc_in": (f * (2 if cfg.activation == "swiglu" else 1) // tp, h),
        "mlp.fc_out": (h, f // tp),
    }


def block_params(cfg: ModelConfig, layer: int, tp: int) -> list[Param]:
    """One transformer block's parameters on one TP rank."""
    linears, p = block_linears(cfg, tp), f"blocks.{layer}"

    def linear(name: str) -> list[Param]:
        rows, cols = linears[name]
        return _linear(f"{p}.{name}", rows, cols, rows if cfg.bias else None)

    return [
        *_norm(f"{p}.norm1", cfg),
        *linear("attn.qkv"),
        *linear("attn.proj"),
        *_norm(f"{p}.norm2", cfg),
        *linear("mlp.fc_in"),
        *linear("mlp.fc_out"),
    ]


def rank_params(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    vpp: int,
    pp_rank: int,
    pp_layers: list[int] | tuple[int, ...] | None = None,
    v_shape: bool = False,
) -> Params:
    """The parameters pipeline rank `pp_rank` holds on each of its TP ranks (all hold the same sizes);
    v_shape: the chunks sit in a V (zbv)."""
    return _rank_params(
        model_key(cfg), tp, pp, vpp, pp_rank, tuple(pp_layers) if pp_layers is not None else None, v_shape
    )


_FIELDS = tuple(f.name for f in fields(ModelConfig))


def model_key(cfg: ModelConfig) -> tuple:
    """The model's fields as a tuple (a cache key; ModelConfig(*key) rebuilds it)."""
    return tuple(getattr(cfg, name) for name in _FIELDS)


@functools.lru_cache(maxsize=4096)
def _rank_params(
    key: tuple, tp: int, pp: int, vpp: int, pp_rank: int, pp_layers: tuple[int, ...] | None, v_shape: bool
) -> Params:
    cfg = ModelConfig(*key)
    chunks = rank_chunks(pp_rank, pp, vpp, cfg.n_layers, list(pp_layers) if pp_layers is not None else None, v_shape)
    first, last = any(c.has_embedding for c in chunks), any(c.has_head for c in chunks)
    vocab_rows = padded_vocab(cfg, tp) // tp
    out: list[Param] = []
    if first or (last and cfg.tie_embeddings):  # a tied head's stage keeps its own copy
        out.append(Param("wte.weight", vocab_rows * cfg.d_model, True))
    if first and cfg.position == "learned":
        out.append(Param("wpe.weight", cfg.seq_len * cfg.d_model, True))
    for layer in sorted(i for c in chunks for i in c.layers):
        out += block_params(cfg, layer, tp)
    if last:
        out += _norm("norm_f", cfg)
        if not cfg.tie_embeddings:
            out.append(Param("lm_head.weight", vocab_rows * cfg.d_model, True))
    return Params(out)


@functools.lru_cache(maxsize=65536)
def chunk_param_count(params: tuple[Param, ...], spec) -> int:
    """Parameters of one chunk (pipeline/partition.ChunkSpec) among a rank's: its blocks, and the embedding or
    head it holds."""
    layers = {f"blocks.{i}." for i in spec.layers}
    total = 0
    for p in params:
        if p.name.startswith("blocks."):
            total += p.numel if p.name[: p.name.index(".", 7) + 1] in layers else 0
        elif p.name.startswith(("wte.", "wpe.")):
            total += p.numel if spec.has_embedding or (spec.has_head and p.name.startswith("wte.")) else 0
        elif spec.has_head:
            total += p.numel
    return total


def total_params(cfg: ModelConfig) -> int:
    """Parameters of the whole serial model (the tied embedding once)."""
    return rank_params(cfg, 1, 1, 1, 0).numel
