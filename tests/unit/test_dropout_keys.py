"""Dropout masks are pure functions of their key (parallel/random.py): (seed, step, micro-batch, layer, site,
tp rank). The same key gives the same mask whatever was drawn before; changing any one part changes it; the
model's loss depends on which micro-batch runs, not on the order micro-batches run in."""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.random import KeyedDropout, keep_mask, keyed_default_rng, mask_seed

KEY = (1234, 10, 3, 2, "mlp_out")  # seed, step, micro-batch, layer, site
SHAPE = (4, 16, 32)


def unrelated_draws() -> None:
    """Move the default stream and draw other keys' masks: none of it may reach a keyed mask."""
    torch.rand(1000)
    F.dropout(torch.ones(77), 0.3)
    keep_mask((1, 2, 3, 4, "attn_out"), 0, (50,), 0.5, torch.device("cpu"))


def test_mask_seed_is_stable_and_63_bit():
    # Pinned: a changed hash would silently change the masks of a resumed run.
    assert mask_seed(KEY) == mask_seed(KEY) == 1109410052757213060
    assert 0 <= mask_seed(KEY, 1) < 2**63


def test_same_key_same_mask_whatever_came_before():
    torch.manual_seed(0)
    first = keep_mask(KEY, None, SHAPE, 0.1, torch.device("cpu"))
    unrelated_draws()
    assert torch.equal(keep_mask(KEY, None, SHAPE, 0.1, torch.device("cpu")), first)
    torch.manual_seed(99)  # another default seed changes nothing either
    assert torch.equal(keep_mask(KEY, None, SHAPE, 0.1, torch.device("cpu")), first)
    dropout = KeyedDropout(0.1).train()
    x = torch.randn(SHAPE)
    out = dropout(x, KEY)
    unrelated_draws()
    assert torch.equal(dropout(x, KEY), out)
    assert torch.equal(out, x * first / 0.9)
    assert 0.05 < 1 - first.float().mean().item() < 0.15  # about p of the elements dropped


@pytest.mark.parametrize("changed", ["step", "microbatch", "layer", "site", "tp_rank"])
def test_any_part_of_the_key_changes_the_mask(changed):
    seed, step, microbatch, layer, site = KEY
    key, tp_rank = KEY, None
    if changed == "step":
        key = (seed, step + 1, microbatch, layer, site)
    elif changed == "microbatch":
        key = (seed, step, microbatch + 1, layer, site)
    elif changed == "layer":
        key = (seed, step, microbatch, layer + 1, site)
    elif changed == "site":
        key = (seed, step, microbatch, layer, "attn_out")
    else:
        tp_rank = 0  # a split activation's mask differs from the replicated one, and between ranks
        assert not torch.equal(
            keep_mask(KEY, 0, SHAPE, 0.5, torch.device("cpu")), keep_mask(KEY, 1, SHAPE, 0.5, torch.device("cpu"))
        )
    assert mask_seed(key, tp_rank) != mask_seed(KEY)
    assert not torch.equal(
        keep_mask(key, tp_rank, SHAPE, 0.5, torch.device("cpu")), keep_mask(KEY, None, SHAPE, 0.5, torch.device("cpu"))
    )


def test_attention_dropout_is_keyed_and_leaves_the_default_stream():
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)

    def attention(key, tp_rank=None):
        with keyed_default_rng(key, tp_rank, torch.device("cpu")):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2)

    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = attention(KEY)
    assert torch.equal(torch.get_rng_state(), before)
    unrelated_draws()
    assert torch.equal(attention(KEY), first)
    assert not torch.equal(attention(KEY, 1), first)
    assert not torch.equal(attention((*KEY[:3], 5, KEY[4])), first)


def test_model_loss_depends_on_the_micro_batch_not_on_the_order():
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=32, vocab_size=128, seq_len=16, dropout=0.2)
    model = GPT(cfg, seed=3).train()
    batches = torch.randint(0, 128, (2, 2, 17), generator=torch.Generator().manual_seed(0))

    def loss(mb: int, step: int = 1) -> float:
        return model(batches[mb][:, :-1], batches[mb][:, 1:], rng_key=(step, mb)).item()

    in_order = [loss(0), loss(1)]
    torch.rand(100)
    reversed_order = [loss(1), loss(0)][::-1]
    assert in_order == reversed_order
    assert loss(0, step=2) != in_order[0]  # another step, other masks
    model.eval()
    assert loss(0) == loss(0, step=2)  # no dropout in eval: the key does not matter
