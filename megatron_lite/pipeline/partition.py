"""Which transformer layers each pipeline rank builds: a pure function of (n_layers, pp, vpp, pp_layers).

The model is cut into `pp * vpp` *virtual stages*, run in order 0, 1, ..., pp*vpp-1. Pipeline rank r holds
`vpp` chunks, and its chunk k is virtual stage `v = k*pp + r`, so consecutive stages always sit on
neighbouring ranks and a micro-batch loops through the ranks vpp times (Narayanan et al. 2021, sec. 2.2).
The zbv schedule places its two chunks in a V instead (`v_shape`, Qi et al. 2024 sec. 6): rank r holds
stages r and 2pp-1-r, so a micro-batch goes down the ranks and back up, and the turn at the last rank (and
the first stage's and the loss's stages on rank 0) stay on one rank.
Virtual stage 0 also owns the embedding, the last one the final norm, the LM head and the loss.

Layers are split uniformly unless `parallel.pp_layers` lists a count per virtual stage; uneven lists exist
because the first and last stages carry the embedding and the head, so giving them fewer blocks balances
the pipeline. A stage in the middle with no block would only forward its input, so it is refused.

Left out on purpose: cost-model-driven automatic balancing (the user states the split instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_lite.errors import ConfigError


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk held by a pipeline rank."""

    chunk: int
    """Local chunk index on its rank, 0..vpp-1."""
    virtual_stage: int
    """Global position in the pipeline: chunk*pp + pp_rank (in a V: pp_rank, then 2pp-1-pp_rank)."""
    layers: range
    """Global indices of the transformer blocks it holds (possibly empty on the first or last stage)."""
    has_embedding: bool
    """True on virtual stage 0: token (and position) embedding runs here."""
    has_head: bool
    """True on the last virtual stage: final norm, LM head and loss run here."""


def virtual_stage(pp_rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Virtual stage held as `chunk` by `pp_rank` (v_shape: two chunks in a V)."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_owner(v: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """Inverse of virtual_stage: (pp_rank, chunk) that holds virtual stage v."""
    if v_shape:
        return (v, 0) if v < pp else (2 * pp - 1 - v, 1)
    return v % pp, v // pp


def _fmt(counts: Sequence[int]) -> str:
    """A list as a user types it in a Hydra override: [2,2,2,2]."""
    return "[" + ",".join(str(c) for c in counts) + "]"


def _suggest(n_layers: int, n_stages: int) -> list[int] | None:
    """A split of n_layers over n_stages that passes the checks below, or None if none exists.

    Spare layers go to the middle stages first: the ends already carry the embedding and the head.
    """
    if n_layers < max(n_stages - 2, 1):
        return None
    if n_layers < n_stages:  # every middle stage gets one block, the ends share what is left
        counts = [0] + [1] * (n_stages - 2) + [0]
        counts[0] += n_layers - (n_stages - 2)
        return counts
    q, rem = divmod(n_layers, n_stages)
    counts = [q] * n_stages
    preference = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for i in preference[:rem]:
        counts[i] += 1
    return counts


def _fix_hint(n_layers: int, n_stages: int) -> str:
    counts = _suggest(n_layers, n_stages)
    if counts is None:
        return f"no split of {n_layers} layers fills {n_stages} virtual stages; lower parallel.pp or parallel.vpp"
    return f"e.g. parallel.pp_layers={_fmt(counts)}"


def layers_per_stage(n_layers: int, pp: int, vpp: int, pp_layers: Sequence[int] | None = None) -> list[int]:
    """Number of transformer blocks on each virtual stage (length pp*vpp); ConfigError if impossible."""
    for key, val in (("parallel.pp", pp), ("parallel.vpp", vpp)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}={val} must be an integer >= 1; use 1 to disable")
    n_stages = pp * vpp
    if pp_layers is None:
        if n_layers % n_stages == 0:
            return [n_layers // n_stages] * n_stages
        key, val = ("parallel.vpp", vpp) if vpp > 1 else ("parallel.pp", pp)
        divisors = ", ".join(str(d) for d in range(1, n_layers + 1) if n_layers % d == 0)
        raise ConfigError(
            f"{key}={val} makes parallel.pp*parallel.vpp={pp}*{vpp}={n_stages} virtual stages, which do not "
            f"divide model.n_layers={n_layers} evenly; pick pp*vpp among {divisors}, or set an uneven split "
            f"({_fix_hint(n_layers, n_stages)})"
        )

    counts = list(pp_layers)
    typed = _fmt(counts)
    if len(counts) != n_stages:
        raise ConfigError(
            f"parallel.pp_layers={typed} has {len(counts)} entries but parallel.pp*parallel.vpp={pp}*{vpp} "
            f"makes {n_stages} virtual stages; give one count per virtual stage, {_fix_hint(n_layers, n_stages)}"
        )
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ConfigError(f"parallel.pp_layers={typed} must hold integers >= 0; {_fix_hint(n_layers, n_stages)}")
    if sum(counts) != n_layers:
        raise ConfigError(
            f"parallel.pp_layers={typed} sums to {sum(counts)} but model.n_layers={n_layers}; "
            f"the counts must add up to the model's layers, {_fix_hint(n_layers, n_stages)}"
        )
    empty_middle = [v for v in range(1, n_stages - 1) if counts[v] == 0]
    if empty_middle:
        raise ConfigError(
            f"parallel.pp_layers={typed} leaves virtual stage {empty_middle[0]} without layers; only the first "
            f"and last stages (which hold the embedding / head) may be empty, {_fix_hint(n_layers, n_stages)}"
        )
    return counts


def stage_layers(n_layers: int, pp: int, vpp: int, pp_layers: Sequence[int] | None = None) -> list[range]:
    """Global layer indices held by each virtual stage, in pipeline order."""
    ranges, start = [], 0
    for count in layers_per_stage(n_layers, pp, vpp, pp_layers):
        ranges.append(range(start, start + count))
        start += count
    return ranges


def rank_chunks(
    pp_rank: int, pp: int, vpp: int, n_layers: int, pp_layers: Sequence[int] | None = None, v_shape: bool = False
) -> list[ChunkSpec]:
    """The vpp chunks pipeline rank `pp_rank` builds, in local chunk order (v_shape: vpp == 2, in a V)."""
    assert 0 <= pp_rank < pp, f"pp_rank={pp_rank} outside 0..{pp - 1}"
    assert not v_shape or vpp == 2, f"a V holds two chunks per rank, not {vpp}"
    ranges = stage_layers(n_layers, pp, vpp, pp_layers)
    last = pp * vpp - 1
    specs = []
    for chunk in range(vpp):
        v = virtual_stage(pp_rank, chunk, pp, v_shape)
        specs.append(
            ChunkSpec(chunk=chunk, virtual_stage=v, layers=ranges[v], has_embedding=v == 0, has_head=v == last)
        )
    return specs
