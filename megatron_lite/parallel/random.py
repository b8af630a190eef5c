"""Dropout randomness under tensor parallelism: one shared stream, one per-TP-rank stream.

Activations that every TP rank holds identically (the residual stream without SP) must drop the same
elements on every rank, so that dropout there uses the default generator, seeded identically everywhere.
Activations that are split over TP ranks (attention heads, sequence shards under SP) are different data
on each rank and need different masks, so dropout there runs inside `tracker.fork()`, which swaps in a
generator seeded by (seed, tp_rank) and swaps the default one back afterwards (Megatron's
"model-parallel RNG", Shoeybi et al. 2019 §B.2).

The tracker's state is saved with checkpoints beside the default generators', and activation
recomputation replays both: `recompute` below restores the default stream (torch's checkpoint does that)
and the tracker's stream to where they stood when the forward first ran, so the recomputed masks are the
masks of the forward.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.utils.checkpoint

TP_SEED_OFFSET = 2718  # keeps the TP stream apart from the default stream of the same seed


class TPRNGTracker:
    """A generator state for TP-split regions, swapped in and out of the device's default generator."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        generator = torch.Generator(device=device)  # same state format as the device's default generator
        generator.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.state = generator.get_state()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the per-TP-rank stream, then restore the default stream where it was."""
        outside = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outside)


def recompute(function: Callable, *args, tracker: TPRNGTracker | None = None):
    """function(*args) without keeping its activations: backward runs it again first (torch's non-reentrant
    checkpoint). Both RNG streams replay, so dropout inside draws the same masks in both runs."""
    def contexts():
        if tracker is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), _replayed(tracker, tracker.state)  # the state as the forward begins

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=contexts)


@contextlib.contextmanager
def _replayed(tracker: TPRNGTracker, state: torch.Tensor):
    """Run the recomputation from the tracker state the forward started at, then put the live state back."""
    live, tracker.state = tracker.state, state
    try:
        yield
    finally:
        tracker.state = live
