"""The training stream, independent of the data-parallel size, and each rank's share of it.

One dataset of n samples: stream index i lies in epoch i // n and maps to sample perm_epoch[i % n], where
perm_epoch = default_rng([seed, epoch]).permutation(n) (`Shuffled`). Several datasets (`data.path` a list,
weights `data.weights`) are blended as Megatron's BlendedDataset does, as a pure function of the index: the
stream is cut into blocks of BLEND_BLOCK indices, each block holds every dataset's share of it rounded to whole
samples (largest remainder) and spread evenly over the block (`Blend`), and dataset k's samples come from its
own stream, reshuffled each of its own epochs with the key [seed, k, epoch]. So after any n samples each
dataset has had its rounded share (off its weight by at most half a sample a block) to within one sample, and
a small dataset repeats (epochs) while a large one is still in its first pass.

Optimizer step k consumes stream indices [k*G, (k+1)*G) for a global batch G, so what a step sees depends only
on (seed, the datasets and weights, k, G), never on how many ranks share it. Within a step, micro-batch j of
DP rank r takes the `micro` indices starting at k*G + (j*dp + r)*micro. Resuming needs only the number of
samples consumed.

Left out on purpose: background prefetching (a window is one memmap slice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_lite.data.documents import Windows, stack

BLEND_BLOCK = 16384  # stream indices per blending block (each dataset needs a share of at least 1 / BLEND_BLOCK)


def _permutation(seed_key: tuple[int, ...], n_samples: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([*seed_key, epoch]).permutation(n_samples)  # (n_samples,) int64
    perm.flags.writeable = False
    return perm


def global_sample_index(seed: int, n_samples: int, i: int) -> int:
    """Dataset index of the i-th sample of one dataset's infinite training stream (epoch i // n reshuffled)."""
    assert n_samples > 0 and i >= 0, (n_samples, i)
    return int(_permutation((seed,), n_samples, i // n_samples)[i % n_samples])


class Shuffled:
    """One dataset as an infinite stream, reshuffled every epoch: `stream(i)` is its i-th sample."""

    def __init__(self, dataset, seed_key: tuple[int, ...]):
        self.dataset, self.seed_key = dataset, seed_key
        self._perms: dict[int, np.ndarray] = {}  # this epoch and the one before (a step may straddle the two)

    def index(self, i: int) -> int:
        n = len(self.dataset)
        epoch = i // n
        if epoch not in self._perms:
            kept = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms = {**kept, epoch: _permutation(self.seed_key, n, epoch)}
        return int(self._perms[epoch][i % n])

    def __call__(self, i: int) -> torch.Tensor:
        return self.dataset[self.index(i)]


class Cycled:
    """A dataset read in order, wrapping around: the fixed validation stream."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, i: int) -> torch.Tensor:
        return self.dataset[i % len(self.dataset)]


def block_counts(weights: list[float], block: int = BLEND_BLOCK) -> np.ndarray:
    """Each dataset's samples in a block of `block`: weights normalized and rounded by largest remainder
    (ties to the earlier dataset), so the counts sum to the block exactly. (K,) int64."""
    w = np.asarray(weights, dtype=np.float64)
    quota = w / w.sum() * block
    counts = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - counts), kind="stable")  # largest fractional part first
    counts[order[: block - counts.sum()]] += 1
    return counts


class Blend:
    """Several streams interleaved by weight: index i of the blend is sample b * counts[k] + r of stream k, where
    b = i // block and position i % block of every block belongs to dataset k as its r-th sample there."""

    def __init__(self, streams: list, weights: list[float], block: int = BLEND_BLOCK):
        self.streams, self.block = streams, block
        self.counts = block_counts(weights, block)
        assert (self.counts > 0).all(), f"a weight below 1/{block} of the blend: {weights}"
        # Dataset k's r-th sample of a block goes to where (r + 1/2) / counts[k] of the block has passed.
        which = np.repeat(np.arange(len(streams)), self.counts)  # (block,)
        rank = np.concatenate([np.arange(c) for c in self.counts])  # (block,)
        order = np.lexsort((which, (rank + 0.5) / self.counts[which]))  # by place in the block, then dataset
        self.which, self.rank = which[order], rank[order]

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset k, index into stream k) of blend index i."""
        b, p = divmod(i, self.block)
        k = int(self.which[p])
        return k, b * int(self.counts[k]) + int(self.rank[p])

    def __call__(self, i: int) -> torch.Tensor:
        k, j = self.locate(i)
        return self.streams[k](j)


def training_stream(datasets: list, weights: list[float], seed: int):
    """The shuffled training stream over one dataset, or the blend of several (stream k keyed [seed, k])."""
    if len(datasets) == 1:
        return Shuffled(datasets[0], (seed,))
    return Blend([Shuffled(d, (seed, k)) for k, d in enumerate(datasets)], weights)


def validation_stream(datasets: list, weights: list[float]):
    """The fixed validation stream: each dataset in order, blended with the training weights."""
    if len(datasets) == 1:
        return Cycled(datasets[0])
    return Blend([Cycled(d) for d in datasets], weights)


class MicroBatches:
    """This rank's micro-batches of a stream, one optimizer step at a time, resumable from `consumed_samples`."""

    def __init__(self, stream, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        # validation.validate() explains a bad batch layout to the user; here it is an invariant.
        assert global_batch_size % (micro_batch_size * dp_size) == 0, (global_batch_size, micro_batch_size, dp_size)
        assert 0 <= dp_rank < dp_size and consumed_samples >= 0, (dp_rank, dp_size, consumed_samples)
        self.stream = stream
        self.global_batch, self.micro, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size
        self.accum = global_batch_size // (micro_batch_size * dp_size)
        # Samples of the stream consumed by all ranks together; a checkpoint stores it to resume exactly.
        self.consumed_samples = consumed_samples

    def step_indices(self) -> list[list[int]]:
        """Stream indices of this rank's micro-batches for the next step, accum lists of micro (no advance)."""
        base = self.consumed_samples
        return [[base + (j * self.dp_size + self.dp_rank) * self.micro + m for m in range(self.micro)]
                for j in range(self.accum)]

    def next_step(self) -> list[torch.Tensor]:
        """accum tensors of shape (micro, seq_len + 1); advances consumed_samples by the global batch."""
        batches = [_stack(self.stream, idx) for idx in self.step_indices()]
        self.consumed_samples += self.global_batch
        return batches


def val_batches(stream, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                n_iters: int) -> list[torch.Tensor]:
    """A fixed validation set of n_iters global batches of a (validation) stream, dealt over DP ranks as a
    training step is: micro-batch j of iteration k on rank r holds stream indices k*G + (j*dp + r)*micro ...
    The set is the same n_iters*G samples at every layout, so val_loss keeps its meaning across an elastic resize."""
    accum = global_batch_size // (micro_batch_size * dp_size)
    return [_stack(stream, [k * global_batch_size + (j * dp_size + dp_rank) * micro_batch_size + m
                            for m in range(micro_batch_size)]) for k in range(n_iters) for j in range(accum)]


def _stack(stream, indices: list[int]) -> torch.Tensor | Windows:
    return stack([stream(i) for i in indices])  # (len(indices), seq_len + 1), with positions under document_mask


@dataclass
class Streams:
    """The configured data (data.path, data.weights) opened for a run."""

    train: object  # training stream: train(i) is sample i, (seq_len + 1,) int64 (with document_mask: and positions)
    val: object | None  # validation stream, when asked for
    val_each: dict[str, object] | None  # each dataset's own validation stream by its path, when asked for
    samples: list[int]  # training samples of each dataset
    weights: list[float]  # each dataset's weight in the blend (unset: its samples, as if the datasets were one)
    val_samples: list[int] | None = None  # validation samples of each dataset, when asked for


def open_streams(path, weights: list[float] | None, seq_len: int, seed: int, validation: bool,
                 each: bool = False, documents: bool = False) -> Streams:
    """The training (and validation) stream of data.path (one prepared directory or a list to blend); with
    `each`, also every dataset's own validation stream (train.eval_per_dataset); with `documents`
    (data.document_mask), samples carry their tokens' positions in their documents."""
    from megatron_lite.config import data_paths, repo_path
    from megatron_lite.data.dataset import TokenData

    paths = data_paths(path)
    data = [TokenData(repo_path(p)) for p in paths]
    train = [d.windows("train", seq_len, documents) for d in data]
    samples = [len(t) for t in train]
    weights = list(weights or samples)
    held_out = [d.windows("val", seq_len, documents) for d in data] if validation else []
    val = validation_stream(held_out, weights) if validation else None
    val_each = {p: Cycled(d) for p, d in zip(paths, held_out)} if validation and each and len(paths) > 1 else None
    return Streams(training_stream(train, weights, seed), val, val_each, samples, weights,
                   [len(d) for d in held_out] if validation else None)
