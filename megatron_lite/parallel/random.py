"""Dropout masks keyed by what they mask, never by the order in which work runs.

Every mask is a pure function of a key

    (seed, step, micro-batch index in the global batch, layer, site, tp_rank or None)

hashed (blake2b, stable across processes and Python versions, unlike `hash()`) into a 63-bit seed for a fresh
generator. Sites: "embed" (layer -1), "attn_probs", "attn_out" and "mlp_out". The micro-batch index is the
sampler's position in the global batch (micro-batch j of DP rank r is j·dp + r, data/sampler.py), so a mask
belongs to the samples it masks. Hence a pipeline that runs micro-batches and chunks in any order (any pp, vpp,
schedule) draws the masks of the single process, and nothing but the step needs saving for an exact resume.

Tensor parallelism: activations every TP rank holds identically (the residual stream without SP) leave the
tp rank out of the key, so all ranks drop the same elements; split activations (attention heads whenever tp > 1,
sequence shards under SP) put it in, so each rank masks its own part differently. This replaces Megatron's
per-rank "model-parallel RNG" stream (Shoeybi et al. 2019 §B.2), which depends on how many draws came before.

Residual and embedding dropout draw an explicit mask (`KeyedDropout`); attention-probability dropout stays
inside SDPA (so flash attention on a GPU keeps its fused dropout) and is keyed by reseeding the default
generator for the call and restoring it afterwards (`keyed_default_rng`).

Context parallelism: every activation is split over the cp ranks by sequence, so each cp rank's masks put its
cp rank in the key (`cp_key`): a cp run's masks are its own, reproducible at the same cp, not the cp=1 run's.
Ring attention keys its attention-probability masks by the global pair of sequence chunks (and row tile) instead
(parallel/context_parallel.py).

Recomputation passes the same key to the rerun, so it redraws the forward's masks with no RNG replay.
Left out on purpose: masks that survive a change of micro_batch_size (the mask's shape is the micro-batch's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint

from megatron_lite.parallel import weight_grad

SITES = ("embed", "attn_probs", "attn_out", "mlp_out")
EMBED_LAYER = -1  # the layer index in the embedding dropout's key

# (seed, step, micro-batch) or, with layer and site appended, one mask's key without the tp rank
Key = tuple


def mask_seed(key: Key, tp_rank: int | None = None) -> int:
    """The 63-bit generator seed of the mask keyed by `key` (+ tp_rank for split activations)."""
    parts = [*key, tp_rank]
    assert all(p is None or isinstance(p, (int, str)) for p in parts), parts  # what json spells one way only
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keep_mask(key: Key, tp_rank: int | None, shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """Bool mask of `shape`, True where an element survives dropout with probability p."""
    generator = torch.Generator(device=device)
    generator.manual_seed(mask_seed(key, tp_rank))
    return torch.rand(shape, generator=generator, device=device) >= p


def cp_key(key: Key, cp_rank: int | None) -> Key:
    """The key of a mask over a context-parallel shard: cp rank r holds other positions (or, in Ulysses'
    attention core, other heads) than rank r' does, so its masks differ; without cp the key is unchanged."""
    return key if cp_rank is None else (*key, "cp", cp_rank)


class KeyedDropout(nn.Module):
    """Dropout whose mask is a function of its key. `tp_rank` is set (by parallelize) when this module drops
    elements of a TP-split activation (sequence shards under SP), None when every TP rank holds the same one;
    `cp_rank` likewise when context parallelism splits the sequence (model/parallelize_cp.py)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.tp_rank: int | None = None
        self.cp_rank: int | None = None

    def forward(self, x: torch.Tensor, key: Key) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = keep_mask(cp_key(key, self.cp_rank), self.tp_rank, x.shape, self.p, x.device)
        return x * keep / (1.0 - self.p)  # autograd keeps only the bool mask for backward

    def extra_repr(self) -> str:
        return f"p={self.p}, tp_rank={self.tp_rank}, cp_rank={self.cp_rank}"


@contextlib.contextmanager
def keyed_default_rng(key: Key, tp_rank: int | None, device: torch.device):
    """Seed the default generator of `device` (and the CPU's) from the key for the block, then put back the
    states they had: for random ops that only take the default generator (SDPA's dropout)."""
    seed = mask_seed(key, tp_rank)
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device's generator only
        yield


def recompute(function: Callable, *args):
    """function(*args) without keeping its activations: backward runs it again first (torch's non-reentrant
    checkpoint). Every mask inside is keyed by an argument (the key travels in args), so the rerun draws the
    forward's masks by construction; no mask depends on where the default generator stands, so there is no RNG
    state to save and restore (preserve_rng_state=False spares a state copy per call)."""
    return torch.utils.checkpoint.checkpoint(
        _weight_grads_in_backward(function), *args, use_reentrant=False, preserve_rng_state=False
    )


def _weight_grads_in_backward(function: Callable) -> Callable:
    """function, run (and rerun in backward) with its weight gradients computed in B under a zero-bubble
    schedule: deferring them would keep what recomputation drops (parallel/weight_grad.py). The forward and
    its rerun must take the same path, or the checkpoint's saved tensors would not match."""

    def run(*args):
        with weight_grad.kept_in_backward():
            return function(*args)

    return run
