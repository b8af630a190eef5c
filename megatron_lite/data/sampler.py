"""The global sample order, independent of the data-parallel size, and each rank's share of it.

The training stream is infinite: stream index i lies in epoch i // n and maps to dataset index
perm_epoch[i % n], where perm_epoch = default_rng([seed, epoch]).permutation(n). Optimizer step k consumes
stream indices [k*G, (k+1)*G) for a global batch G, so what a step sees depends only on (seed, k, G), never
on how many ranks share it. Within a step, micro-batch j of DP rank r takes the `micro` indices starting at
k*G + (j*dp + r)*micro. Resuming needs only the number of samples consumed.
"""

from __future__ import annotations

import numpy as np
import torch


class GlobalOrder:
    """Stream index -> dataset index, caching the current epoch's permutation."""

    def __init__(self, n_samples: int, seed: int):
        self.n, self.seed = n_samples, seed
        self._epoch, self._perm = -1, None

    def __getitem__(self, i: int) -> int:
        epoch = i // self.n
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return int(self._perm[i % self.n])


class MicroBatches:
    """This rank's micro-batches, one optimizer step at a time, resumable from `consumed_samples`."""

    def __init__(self, dataset, seed: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0):
        assert global_batch_size % (micro_batch_size * dp_size) == 0, (global_batch_size, micro_batch_size, dp_size)
        self.dataset, self.order = dataset, GlobalOrder(len(dataset), seed)
        self.global_batch, self.micro, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size
        self.accum = global_batch_size // (micro_batch_size * dp_size)
        self.consumed_samples = consumed_samples

    def step_indices(self) -> list[list[int]]:
        """Dataset indices of this rank's micro-batches for the next step (does not advance)."""
        base = self.consumed_samples
        return [[self.order[base + (j * self.dp_size + self.dp_rank) * self.micro + m] for m in range(self.micro)]
                for j in range(self.accum)]

    def next_step(self) -> list[torch.Tensor]:
        """accum tensors of shape (micro, seq_len + 1); advances consumed_samples by the global batch."""
        batches = [self.dataset.stack(idx) for idx in self.step_indices()]
        self.consumed_samples += self.global_batch
        return batches


def val_batches(dataset, micro_batch_size: int, dp_rank: int, dp_size: int, n_iters: int) -> list[torch.Tensor]:
    """A fixed validation set: micro-batch k of rank r holds samples (k*dp + r)*micro ... (mod len)."""
    return [dataset.stack([((k * dp_size + dp_rank) * micro_batch_size + m) % len(dataset)
                           for m in range(micro_batch_size)]) for k in range(n_iters)]
