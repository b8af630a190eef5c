"""A micro-batch's documents as the model uses them (data.document_mask; data/documents.py says where they come from).

`DocumentMask` holds, for the whole window, each input token's position in its document and its document index
(`segments`, counting up along the window), which labels are predicted, and what the summed loss is divided by.
Under context parallelism a rank shards the per-token tensors with the sequence (`local`) and keeps the whole
window's segments, from which ring attention takes each block's and Ulysses the whole sequence's.

The attention mask: query i sees key j when j <= i and both lie in the same document. Two ways to compute it:
  - on CUDA (bf16/fp16, no attention dropout): FlashAttention's variable-length kernel through torch
    (`varlen_attention`), the micro-batch's windows laid end to end as one packed sequence cut at every document
    start (cu_seqlens), so no work is spent on pairs across documents;
  - elsewhere torch's SDPA with a boolean (b, 1, s, s) block-diagonal causal mask
    (`parallel.context_parallel.document_mask`). On CPU, at seq 1024 with documents of 128 tokens on average
    (tools/bench_documents.py), it took 1.42-1.44x causal SDPA's time forward + backward (a mask computes every
    block, causal skips half); one SDPA call per document, the other way, took 1.29-1.61x from run to run (its
    calls are small), so the mask stays: as fast, steadier, and without reading the boundaries on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass
class DocumentMask:
    positions: torch.Tensor  # (b, s) each input token's position in its document (this rank's share under cp)
    segments: torch.Tensor  # (b, s) each input token's document index in the whole window (never sharded)
    predicted: torch.Tensor  # (b, s) bool: label t is predicted (not a document's first token); this rank's share
    loss_tokens: float  # the summed loss of this micro-batch is divided by this (data/documents.normalise)

    @classmethod
    def of(cls, windows) -> DocumentMask:
        """From a data.documents.Windows (positions (b, s + 1)) on the model's device."""
        positions = windows.positions
        inputs = positions[:, :-1]
        return cls(inputs, torch.cumsum(inputs == 0, dim=1), positions[:, 1:] != 0, windows.loss_tokens or 1.0)

    def local(self, shard) -> DocumentMask:
        """This rank's share of the per-token tensors, shard: tokens (b, s) -> this rank's (b, s_local)."""
        return replace(self, positions=shard(self.positions), predicted=shard(self.predicted))

    @functools.cached_property
    def packed(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens (n_docs + 1,) int32, the longest document) of the windows laid end to end, each window
        starting a document: the variable-length kernel's description, computed once per micro-batch."""
        segments = self.segments
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        first = torch.nonzero(starts.flatten()).flatten()
        cu = torch.cat([first, first.new_tensor([segments.numel()])]).to(torch.int32)
        return cu, int(torch.diff(cu).max())


def varlen_applies(q: torch.Tensor) -> bool:
    """Whether FlashAttention's variable-length kernel runs q's attention: CUDA, bf16/fp16, a head dim of at most
    256 and a multiple of 8, compute capability 8.0 or later, and a torch that has it."""
    if (
        q.device.type != "cuda"
        or q.dtype not in (torch.bfloat16, torch.float16)
        or q.shape[-1] % 8
        or q.shape[-1] > 256
    ):
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask) -> torch.Tensor:
    """Causal attention within each document by torch's variable-length FlashAttention: q (b, heads, s, hd), k and
    v (b, kv_heads, s, hd) over whole windows (docs.segments). Returns (b, heads, s, hd), a view of the kernel's
    (b·s, heads, hd) output, so the output projection reads it without a copy."""
    from torch.nn.attention.varlen import varlen_attn

    b, heads, s, hd = q.shape
    cu, longest = docs.packed

    def packed(x: torch.Tensor) -> torch.Tensor:  # (b, h, s, hd), a transposed view of (b, s, h, hd) -> (b·s, h, hd)
        return x.transpose(1, 2).reshape(b * s, x.shape[1], hd)

    out = varlen_attn(
        packed(q), packed(k), packed(v), cu, cu, longest, longest, window_size=(-1, 0), enable_gqa=heads != k.shape[1]
    )
    return out.view(b, s, heads, hd).transpose(1, 2)


def reduce_loss(losses: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
    """A micro-batch's loss from its per-token losses (b·s,): their mean, or, given documents, the sum over the
    labels predicted divided by docs.loss_tokens (the step's count per micro-batch)."""
    if docs is None:
        return losses.mean()
    return torch.where(docs.predicted.flatten(), losses, 0.0).sum() / docs.loss_tokens
