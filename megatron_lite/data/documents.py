"""Where each training window's documents begin (data.document_mask), and micro-batches that carry it.

A window is seq_len + 1 consecutive tokens of the prepared stream (data/dataset.py), which joins documents with
an end-of-document token. With data.document_mask each token also gets its position in its document: 0 at a
document's first token, counting up from there. The window's first token is 0 too: the part of a document that
began in an earlier window is a document of its own here, since this window cannot attend to that earlier part
(Megatron-LM's reset_position_ids counts the same way). Everything the model needs follows from the positions:
  - a token attends to the tokens of its own document only: the document index of a token is the number of 0
    positions up to it (`segments`);
  - learned positions and RoPE take these positions instead of the place in the window;
  - label t (token t + 1) is predicted only when it is not a document's first token, i.e. when position t + 1
    is not 0: a document's first token is not predicted from the previous document (Megatron-LM's
    --eod-mask-loss drops the same predictions, those whose input is the end-of-document token).

Document starts come from the prepared index (<split>.idx.npy, each document's first offset), or, for data
prepared without one, from the tokens: a token after the end-of-document id begins a document. The two agree
unless a document's text itself holds the end-of-document token, where the index is right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


def positions_from_starts(start: int, length: int, doc_starts: np.ndarray) -> np.ndarray:
    """Each token's position in its document for the tokens [start, start + length) of a stream whose documents
    begin at doc_starts (sorted, from 0); the first token counts from 0. (length,) int64."""
    offsets = np.arange(start, start + length, dtype=np.int64)
    begins = doc_starts[np.searchsorted(doc_starts, offsets, side="right") - 1]  # each token's document start
    return offsets - np.maximum(begins, start)


def positions_from_eos(window: np.ndarray, eos_id: int) -> np.ndarray:
    """Each token's position in its document, a document beginning after every end-of-document token and at the
    window's first token. (len(window),) int64."""
    starts = np.zeros(len(window), dtype=bool)
    starts[0] = True
    starts[1:] = window[:-1] == eos_id
    index = np.arange(len(window), dtype=np.int64)
    return index - np.maximum.accumulate(np.where(starts, index, 0))


@dataclass
class Windows:
    """A micro-batch of windows with the positions of their tokens in their documents (data.document_mask).

    tokens and positions are (b, seq_len + 1); loss_tokens is what this micro-batch's summed loss is divided by,
    set for each step by `normalise` so that the step's loss is the mean over the tokens the whole global batch
    predicts, whatever the layout (the model's forward reads it)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    loss_tokens: float | None = None

    def to(self, device, non_blocking: bool = False) -> Windows:
        return replace(
            self,
            tokens=self.tokens.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
        )

    def predicted(self) -> int:
        """Labels predicted: those that are not a document's first token."""
        return int((self.positions[:, 1:] != 0).sum())

    def attended(self) -> int:
        """Sum over the windows' documents of length squared (inputs only): the attention work with the mask is
        this over b·seq_len² of the causal mask's."""
        starts = (self.positions[:, :-1] == 0).flatten()  # every window begins a document: none spans two rows
        bounds = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([starts.numel()], device=starts.device)])
        lengths = torch.diff(bounds)  # each document's length, the windows laid end to end
        return int((lengths.double() ** 2).sum())


def stack(samples: list) -> torch.Tensor | Windows:
    """Samples of a stream as a micro-batch: tokens (b, seq_len + 1), or Windows of (tokens, positions) pairs."""
    if isinstance(samples[0], tuple):
        return Windows(torch.stack([t for t, _ in samples]), torch.stack([p for _, p in samples]))
    return torch.stack(samples)


def normalise(micro_batches: list, ctx) -> tuple[int, int] | None:
    """Set each micro-batch's loss_tokens so that the step's loss is the mean over the tokens the global batch
    predicts: N / (m · dp) for N predicted labels over the dp ranks' m micro-batches each. Returns (N, the global
    batch's `attended`), one all-reduce over dp; None for plain token micro-batches."""
    if not micro_batches or not isinstance(micro_batches[0], Windows):
        return None
    counts = torch.tensor(
        [sum(w.predicted() for w in micro_batches), sum(w.attended() for w in micro_batches)],
        dtype=torch.float64,
        device=ctx.device,
    )
    if ctx.dp_size > 1:
        torch.distributed.all_reduce(counts, group=ctx.dp_group)
    predicted, attended = (int(c) for c in counts.tolist())
    share = max(predicted, 1) / (len(micro_batches) * ctx.dp_size)
    for w in micro_batches:
        w.loss_tokens = share
    return predicted, attended
