"""Dropout under tensor parallelism (tp = world size, gloo): which masks agree across TP ranks and which differ.

- Replicated activations (residual stream without SP) must drop the same elements on every TP rank,
  or the replicas diverge: the hidden states after all blocks are compared across ranks, exactly.
- TP-split activations (attention heads; sequence shards under SP) must use different masks per rank:
  attention dropout is keyed with this rank's tp rank, and the SP residual-dropout mask patterns differ by rank.
- The keyed context for SDPA's dropout leaves the default stream exactly where it was.
- Recomputation (selective, full) reruns with the same keys: loss and every gradient shard are bit-identical
  to no recomputation, with and without SP; a rerun with another key would not be (checked too).
Exits non-zero naming the first violated property.
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model import gpt as gpt_module
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.parallel import random as tp_random
from tests.distributed.rank_runner import leave_world


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def fail(msg: str) -> None:
    sys.exit(f"rank {dist.get_rank()}: {msg}")


def loss_and_grads(cfg: ModelConfig, tokens: torch.Tensor, sp: bool, recompute: str):
    """Loss and gradient shards of one forward/backward of a tp=world model, dropout keyed by (step 3, mb 1)."""
    model = parallelize(GPT(cfg, tp=dist.get_world_size()), dist.group.WORLD, sp).train()
    model.set_recompute(recompute)
    loss = model(tokens[:, :-1], tokens[:, 1:], rng_key=(3, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rerun_with_other_key(function, *args):
    """tp_random.recompute whose rerun (torch's checkpoint calls the function a second time in backward) gets
    the key of the next step: what a recomputation drawing fresh masks would do."""
    calls = []

    def shifted(*inputs):
        calls.append(None)
        if len(calls) > 1:  # the key: the last tuple argument (the documents, None here, may follow it)
            at = max(i for i, x in enumerate(inputs) if isinstance(x, tuple))
            seed, step, microbatch, *rest = inputs[at]
            inputs = (*inputs[:at], (seed, step + 1, microbatch, *rest), *inputs[at + 1 :])
        return function(*inputs)

    return tp_random.recompute(shifted, *args)


def main() -> None:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    device = torch.device("cpu")

    # 1. The keys themselves: the tp rank in the key splits masks, no tp rank shares them.
    key = (5, 1, 0, 0, "attn_probs")
    torch.manual_seed(5)
    shared_before = torch.get_rng_state()
    with tp_random.keyed_default_rng(key, rank, device):
        tp_mask = F.dropout(torch.ones(4096), 0.5)
    if not torch.equal(torch.get_rng_state(), shared_before):
        fail("keyed_default_rng moved the default stream")
    shared_mask = tp_random.keep_mask(key, None, (4096,), 0.5, device)
    tp_masks, shared_masks = gather(tp_mask), gather(shared_mask)
    if any(torch.equal(tp_masks[0], m) for m in tp_masks[1:]):
        fail("TP-region masks agree across TP ranks")
    if not all(torch.equal(shared_masks[0], m) for m in shared_masks[1:]):
        fail("shared-stream masks differ across TP ranks")

    # 2. The model, without and with sequence parallelism.
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=512, seq_len=16, dropout=0.1)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    keyed_default_rng = gpt_module.keyed_default_rng
    for sp in (False, True):
        model = parallelize(copy.deepcopy(GPT(cfg, tp=dist.get_world_size())), group, sp).train()
        masks, attention_ranks = [], []
        model.blocks[0].drop.register_forward_hook(lambda mod, inp, out: masks.append((out == 0) & (inp[0] != 0)))

        def recorded(key, tp_rank, dev):
            attention_ranks.append(tp_rank)
            return keyed_default_rng(key, tp_rank, dev)

        gpt_module.keyed_default_rng = recorded
        try:
            hidden = model.hidden_states(tokens, rng_key=(1, 0))
        finally:
            gpt_module.keyed_default_rng = keyed_default_rng
        if attention_ranks != [rank] * cfg.n_layers:
            fail(f"sp={sp}: attention dropout keys carry tp ranks {attention_ranks}, want {rank} per layer")
        if not sp and not all(torch.equal(hidden, h) for h in gather(hidden)):
            fail("sp=False: hidden states differ across TP ranks (replicated dropout masks disagree)")
        patterns = gather(masks[0])
        if sp and any(torch.equal(patterns[0], p) for p in patterns[1:]):
            fail("sp=True: residual dropout masks on sequence shards repeat across TP ranks")
        if not sp and not all(torch.equal(patterns[0], p) for p in patterns[1:]):
            fail("sp=False: residual dropout masks differ across TP ranks")
        if not masks[0].any():
            fail(f"sp={sp}: residual dropout dropped nothing")

    # 3. Recomputation reruns with the forward's keys.
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(4))
    for sp in (False, True):
        runs = {}
        for mode in ("none", "selective", "full"):
            runs[mode] = loss_and_grads(cfg, tokens, sp, mode)
        for mode in ("selective", "full"):
            if not torch.equal(runs[mode][0], runs["none"][0]):
                fail(f"sp={sp} recompute={mode}: loss {runs[mode][0].item()} != {runs['none'][0].item()}")
            for name, g in runs["none"][1].items():
                if not torch.equal(runs[mode][1][name], g):
                    fail(f"sp={sp} recompute={mode}: gradient of {name} differs")
        # Negative control: a rerun under another step's key draws other masks, and the gradients show it.
        gpt_module.recompute = rerun_with_other_key
        try:
            _, grads = loss_and_grads(cfg, tokens, sp, "full")
            if all(torch.equal(grads[n], g) for n, g in runs["none"][1].items()):
                fail(f"sp={sp}: a rerun with another key still matched; the check above proves nothing")
        finally:
            gpt_module.recompute = tp_random.recompute
    if rank == 0:
        print("dropout checks passed")
    leave_world()  # tests/distributed/rank_runner.py says why


if __name__ == "__main__":
    main()
