"""Tensor/sequence parallel vs the serial model with the same weights: loss, logits and every gradient.

Run under torchrun (gloo); the whole world is one TP group. argv[1] = kernels backend of the parallel model
(torch, or triton: fused norms, RoPE, SwiGLU/GeLU and the vocab-parallel cross-entropy kernel, which
combine their statistics across TP ranks); the serial model always runs the torch references. Each rank compares its gradient shards with the
same shards of the serial model's gradients (so, over all ranks, every gathered gradient is compared).
Tolerances: loss and logits 1e-5, gradients 1e-5 absolute + 1e-4 relative (cross-rank sums reorder fp32
additions). Exits non-zero naming the first mismatch; rank 0 prints the largest differences seen.
"""

import copy
import sys

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.layers import shard_segments
from megatron_lite.parallel.tensor_parallel import parallelize

FLAVOURS = {
    "gpt2": dict(n_layers=2, n_heads=4, d_model=64, vocab_size=1000, seq_len=16),
    "llama-gqa": dict(n_layers=2, n_heads=8, n_kv_heads=4, d_model=64, ffn_hidden=96, vocab_size=1000,
                      seq_len=16, norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                      tie_embeddings=False),
}


def segments_of(name: str, cfg: ModelConfig, full: torch.Tensor, dim: int) -> list[int]:
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        return [cfg.n_heads * cfg.head_dim] + [cfg.kv_heads * cfg.head_dim] * 2
    if name.endswith("mlp.fc_in.weight") or name.endswith("mlp.fc_in.bias"):
        return [cfg.ffn] * (2 if cfg.activation == "swiglu" else 1)
    return [full.shape[dim]]


def compare(flavour: str, sp: bool, worst: dict, backend: str) -> None:
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
        logits_gap = (serial(x) - parallel(x)).abs().max().item()
    loss_gap = abs(loss_s.item() - loss_p.item())
    if loss_gap > 1e-5 or logits_gap > 1e-5:
        sys.exit(f"{tag}: loss gap {loss_gap:.2e}, logits gap {logits_gap:.2e}")
    serial_params = dict(serial.named_parameters())
    names = set()
    for name, p in parallel.named_parameters():
        names.add(name)
        want = serial_params[name].grad
        if getattr(p, "tensor_model_parallel", False):
            want = shard_segments(want, segments_of(name, cfg, want, p.partition_dim), p.partition_dim, group)
        if p.grad is None or p.grad.shape != want.shape:
            sys.exit(f"{tag}: {name} has no gradient or the wrong shape")
        gap = (p.grad - want).abs().max().item()
        worst[tag] = max(worst.get(tag, 0.0), gap)
        if not torch.allclose(p.grad, want, rtol=1e-4, atol=1e-5):
            sys.exit(f"{tag}: gradient of {name} differs by {gap:.2e}")
    if names != set(serial_params):
        sys.exit(f"{tag}: parameter names differ: {sorted(names ^ set(serial_params))}")
    worst[tag + " loss"] = loss_gap


def main(backend: str) -> None:
    dist.init_process_group("gloo")
    worst: dict = {}
    for flavour in FLAVOURS:
        for sp in (False, True):
            compare(flavour, sp, worst, backend)
    if dist.get_rank() == 0:
        for tag, gap in worst.items():
            print(f"max |diff| {tag}: {gap:.2e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torch")
