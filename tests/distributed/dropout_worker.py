"""Dropout under tensor parallelism (tp = world size, gloo): which masks agree across TP ranks and which differ.

- Replicated activations (residual stream without SP) must drop the same elements on every TP rank,
  or the replicas diverge: the hidden states after all blocks are compared across ranks, exactly.
- TP-split activations (attention heads; sequence shards under SP) must use different masks per rank:
  the per-rank stream is consumed by a forward, and the SP residual-dropout mask patterns differ by rank.
- fork() leaves the shared stream exactly where it was.
Exits non-zero naming the first violated property.
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.random import TPRNGTracker
from megatron_lite.parallel.tensor_parallel import parallelize


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def fail(msg: str) -> None:
    sys.exit(f"rank {dist.get_rank()}: {msg}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    device = torch.device("cpu")

    # 1. The tracker itself.
    torch.manual_seed(5)
    tracker = TPRNGTracker(5, rank, device)
    shared_before = torch.get_rng_state()
    with tracker.fork():
        tp_mask = F.dropout(torch.ones(4096), 0.5)
    if not torch.equal(torch.get_rng_state(), shared_before):
        fail("fork() moved the shared stream")
    shared_mask = F.dropout(torch.ones(4096), 0.5)
    tp_masks, shared_masks = gather(tp_mask), gather(shared_mask)
    if any(torch.equal(tp_masks[0], m) for m in tp_masks[1:]):
        fail("TP-region masks agree across TP ranks")
    if not all(torch.equal(shared_masks[0], m) for m in shared_masks[1:]):
        fail("shared-stream masks differ across TP ranks")

    # 2. The model, without and with sequence parallelism.
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=512, seq_len=16, dropout=0.1)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    for sp in (False, True):
        torch.manual_seed(0)
        tracker = TPRNGTracker(0, rank, device)
        model = parallelize(copy.deepcopy(GPT(cfg, tp=dist.get_world_size())), group, sp, tracker).train()
        masks = []
        model.blocks[0].drop.register_forward_hook(lambda mod, inp, out: masks.append((out == 0) & (inp[0] != 0)))
        tp_state = tracker.state.clone()
        hidden = model.hidden_states(tokens)
        if torch.equal(tracker.state, tp_state):
            fail(f"sp={sp}: the forward never drew from the per-TP-rank stream (attention dropout)")
        if not sp and not all(torch.equal(hidden, h) for h in gather(hidden)):
            fail("sp=False: hidden states differ across TP ranks (replicated dropout masks disagree)")
        patterns = gather(masks[0])
        if sp and any(torch.equal(patterns[0], p) for p in patterns[1:]):
            fail("sp=True: residual dropout masks on sequence shards repeat across TP ranks")
        if not sp and not all(torch.equal(patterns[0], p) for p in patterns[1:]):
            fail("sp=False: residual dropout masks differ across TP ranks")
        if not masks[0].any():
            fail(f"sp={sp}: residual dropout dropped nothing")
    if rank == 0:
        print("dropout checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
