"""Where each token sits: RoPE's tables and rotation, and how a rank holds each sequence (all of it, in order;
context parallelism swaps in a shard, model/parallelize_cp.py). With data.document_mask positions count from each
document's start instead (model/documents.py gives them per token; RoPE then takes table rows by position id)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_lite.kernels import ops


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim), halves repeated (HF Llama's rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # (s, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, hd)
    return angles.cos(), angles.sin()


class WholeSequence:
    """How a rank holds each sequence: all of it, in order. Context parallelism swaps in a shard of it
    (model/parallelize_cp.py: two of 2*cp chunks) with the same four members."""

    size = 1  # ranks that share one sequence

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """tokens or labels (b, s) -> this rank's (b, s / size)."""
        return x

    def positions(self, s_local: int, device) -> torch.Tensor:
        """Global position ids (s_local,) of this rank's tokens."""
        return torch.arange(s_local, device=device)

    def rows(self, table: torch.Tensor, s_local: int) -> torch.Tensor:
        """The rows of a per-position table (RoPE's cos/sin) for this rank's tokens."""
        return table[:s_local]  # a view: the tables cover model.seq_len, a sequence may be shorter


class Rope(NamedTuple):
    """RoPE's cos/sin tables over model.seq_len and the sequence layout that picks this rank's rows."""

    cos: torch.Tensor
    sin: torch.Tensor
    sequence: WholeSequence

    def at(self, s_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequence.rows(self.cos, s_local), self.sequence.rows(self.sin, s_local)  # (s_local, hd) each


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch", positions: torch.Tensor | None = None
) -> torch.Tensor:
    """x: (b, heads, s, hd); rotate pairs (i, i + hd/2) by the position angle (megatron_lite/kernels/rope.py):
    row t of the tables, or row positions[b, t] of them given positions (b, s)."""
    return ops.apply_rope(x, cos, sin, backend, positions)
