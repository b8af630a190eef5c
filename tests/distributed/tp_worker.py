"""Tensor/sequence parallel vs the serial model with the same weights: loss, logits and every gradient.

Run on every rank of a gloo world by tests/distributed/test_tensor_parallel.py (ranks.on_ranks); the whole
world is one TP group. `errors(backend)`: backend is the parallel model's kernels (torch, or triton: fused
norms, RoPE, SwiGLU/GeLU and the vocab-parallel cross-entropy kernel, which combine their statistics across TP
ranks); the serial model always runs the torch references. Each rank compares its gradient shards with the
same shards of the serial model's gradients (so, over all ranks, every gathered gradient is compared).
Each comparison is a relative error ||got - want|| / ||want||; every rank returns, per case, the largest
errors seen over all ranks, and the test holds them to TOL.
"""

import copy

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.model import fused_rows
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.parallel.layers import shard_segments
from tests.utils.models import LLAMA_STYLE

FLAVOURS = {
    "gpt2": dict(n_layers=2, n_heads=4, d_model=64, vocab_size=1000, seq_len=16),
    "llama-gqa": dict(
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        d_model=64,
        ffn_hidden=96,
        vocab_size=1000,
        seq_len=16,
        **LLAMA_STYLE,
    ),
}

# Relative to each tensor's norm, not absolute: an absolute 1e-5 is met by every entry smaller than 1e-5,
# however wrong (the llama norm2 gradients peak at 8.8e-4, so the old allclose(atol=1e-5, rtol=1e-4) let them
# be 1% off). In fp32 the parallel model only reorders additions (cross-rank sums, sharded matmuls, the
# kernels' fused reductions): a few ulps (eps 1.2e-7) of the norm, measured <= 5.1e-7. A missing or doubled
# reduction is O(1) (0.4 without the all-reduce in copy_to_tp's backward), a 1.01 scale 1e-2.
TOL = 1e-5


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def worse(a: float, b: float) -> float:
    """The larger error, where nan (a comparison that failed to produce a number) is larger than any."""
    return b if b != b or b > a else a


def worst_over_ranks(worst: dict[str, float]) -> dict[str, float]:
    """{case: largest error over all ranks} (each rank saw its own shards); nan becomes inf, which gloo's MAX
    keeps and JSON carries."""
    values = torch.nan_to_num(torch.tensor(list(worst.values()), dtype=torch.float64), nan=float("inf"))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(worst, values.tolist()))


def segments_of(name: str, cfg: ModelConfig, full: torch.Tensor, dim: int) -> list[int]:
    return fused_rows.segments_of(name, cfg) or [full.shape[dim]]


def compare(flavour: str, sp: bool, worst: dict, backend: str) -> None:
    """Record in `worst` this rank's largest errors of the case (loss and logits; gradients). A missing gradient
    or parameter is not an error size: it raises."""
    group, tp = dist.group.WORLD, dist.get_world_size()
    cfg = ModelConfig(**FLAVOURS[flavour])
    torch.manual_seed(0)
    serial = GPT(cfg, tp=tp)
    parallel = parallelize(copy.deepcopy(serial), group, sequence_parallel=sp)
    parallel.set_kernels(backend)  # the serial model keeps the torch references
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    tag = f"{flavour} tp={tp} sp={sp} kernels={backend}"

    loss_s, loss_p = serial(x, y), parallel(x, y)
    loss_s.backward()
    loss_p.backward()
    with torch.no_grad():
        logits_error = relative_error(parallel(x), serial(x))
    loss_error = relative_error(loss_p.detach(), loss_s.detach())
    serial_params = dict(serial.named_parameters())
    names = set()
    for name, p in parallel.named_parameters():
        names.add(name)
        want = serial_params[name].grad
        if getattr(p, "tensor_model_parallel", False):
            want = shard_segments(want, segments_of(name, cfg, want, p.partition_dim), p.partition_dim, group)
        if p.grad is None or p.grad.shape != want.shape:
            raise AssertionError(f"{tag}: {name} has no gradient or the wrong shape")
        worst[tag + " gradients"] = worse(worst.get(tag + " gradients", 0.0), relative_error(p.grad, want))
    if names != set(serial_params):
        raise AssertionError(f"{tag}: parameter names differ: {sorted(names ^ set(serial_params))}")
    worst[tag + " loss, logits"] = worse(loss_error, logits_error)


def errors(backend: str) -> dict[str, float]:
    """{case: largest relative error over all ranks} for both flavours, sp off and on."""
    worst: dict = {}
    for flavour in FLAVOURS:
        for sp in (False, True):
            compare(flavour, sp, worst, backend)
    return worst_over_ranks(worst)
