"""The global sample order, independent of the data-parallel size, and each rank's share of it.

The training stream is infinite: stream index i lies in epoch i // n and maps to dataset index
perm_epoch[i % n], where perm_epoch = default_rng([seed, epoch]).permutation(n). Optimizer step k consumes
stream indices [k*G, (k+1)*G) for a global batch G, so what a step sees depends only on (seed, k, G), never
on how many ranks share it. Within a step, micro-batch j of DP rank r takes the `micro` indices starting at
k*G + (j*dp + r)*micro. Resuming needs only the number of samples consumed.

Left out on purpose: changing the global batch size mid-run (a resumed run must keep G so that
consumed_samples still falls on a step boundary) and background prefetching (a window is one memmap slice).
"""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=2)  # the current epoch, plus the next one while a step straddles the boundary
def _epoch_permutation(seed: int, n_samples: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n_samples)  # (n_samples,) int64
    perm.flags.writeable = False  # shared by every caller through the cache
    return perm


def global_sample_index(seed: int, n_samples: int, i: int) -> int:
    """Dataset index of the i-th sample of the infinite training stream (epoch i // n_samples reshuffled)."""
    assert n_samples > 0 and i >= 0, (n_samples, i)
    return int(_epoch_permutation(seed, n_samples, i // n_samples)[i % n_samples])


class MicroBatches:
    """This rank's micro-batches, one optimizer step at a time, resumable from `consumed_samples`."""

    def __init__(self, dataset, seed: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0):
        # validation.validate() explains a bad batch layout to the user; here it is an invariant.
        assert global_batch_size % (micro_batch_size * dp_size) == 0, (global_batch_size, micro_batch_size, dp_size)
        assert 0 <= dp_rank < dp_size and consumed_samples >= 0, (dp_rank, dp_size, consumed_samples)
        self.dataset, self.seed = dataset, seed
        self.global_batch, self.micro, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size
        self.accum = global_batch_size // (micro_batch_size * dp_size)
        # Samples of the stream consumed by all ranks together; a checkpoint stores it to resume exactly.
        self.consumed_samples = consumed_samples

    def step_indices(self) -> list[list[int]]:
        """Dataset indices of this rank's micro-batches for the next step, accum lists of micro (no advance)."""
        n, base = len(self.dataset), self.consumed_samples
        return [[global_sample_index(self.seed, n, base + (j * self.dp_size + self.dp_rank) * self.micro + m)
                 for m in range(self.micro)] for j in range(self.accum)]

    def next_step(self) -> list[torch.Tensor]:
        """accum tensors of shape (micro, seq_len + 1); advances consumed_samples by the global batch."""
        batches = [_stack(self.dataset, idx) for idx in self.step_indices()]
        self.consumed_samples += self.global_batch
        return batches


def val_batches(dataset, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                n_iters: int) -> list[torch.Tensor]:
    """A fixed validation set of n_iters global batches, dealt over DP ranks as a training step is: micro-batch
    j of iteration k on rank r holds samples k*G + (j*dp + r)*micro ... (mod len). The set is the same
    n_iters*G samples at every layout, so val_loss keeps its meaning across an elastic resize."""
    accum = global_batch_size // (micro_batch_size * dp_size)
    return [_stack(dataset, [(k * global_batch_size + (j * dp_size + dp_rank) * micro_batch_size + m) % len(dataset)
                             for m in range(micro_batch_size)]) for k in range(n_iters) for j in range(accum)]


def _stack(dataset, indices: list[int]) -> torch.Tensor:
    return torch.stack([dataset[i] for i in indices])  # (len(indices), seq_len + 1)
