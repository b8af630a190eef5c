"""Activation recomputation (train.recompute) is exact: with dropout 0.1, `selective` and `full` (every
block or every k-th) give bit-identical loss and gradients to `none`, for both model flavours, and keep
fewer activations: the rerun gets the forward's dropout keys. Under tensor parallelism: dropout_worker.py
in tests/distributed."""

import copy

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from tests.utils.models import LLAMA_STYLE

FLAVOURS = {
    "gpt2": dict(n_layers=3, n_heads=4, d_model=64, vocab_size=300, seq_len=32, dropout=0.1),
    "llama-gqa": dict(
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_model=64,
        ffn_hidden=96,
        vocab_size=300,
        seq_len=32,
        **LLAMA_STYLE,
        dropout=0.1,
    ),
}
MODES = [("selective", 1), ("full", 1), ("full", 2)]


def loss_and_grads(model: GPT, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(7)  # masks are keyed, not drawn from this stream; a different seed per mode would pass too
    loss = model(tokens[:, :-1], tokens[:, 1:], rng_key=(2, 5))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model: GPT, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after the forward (recompute stores only block/core inputs)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return total


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_recompute_is_bit_identical_with_dropout(flavour):
    cfg = ModelConfig(**FLAVOURS[flavour])
    torch.manual_seed(0)
    reference = GPT(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = loss_and_grads(copy.deepcopy(reference), tokens)
    bytes_ref = saved_bytes(copy.deepcopy(reference), tokens)
    for mode, every in MODES:
        model = copy.deepcopy(reference)
        model.set_recompute(mode, every)
        loss, grads = loss_and_grads(model, tokens)
        assert torch.equal(loss, loss_ref), (mode, every, (loss - loss_ref).item())
        for name, g in grads_ref.items():
            assert torch.equal(grads[name], g), (mode, every, name, (grads[name] - g).abs().max().item())
        assert saved_bytes(model, tokens) < bytes_ref, (mode, every)


def test_different_dropout_masks_change_the_loss():
    """The exactness above means something only if dropout actually draws: another key, another loss."""
    cfg = ModelConfig(**FLAVOURS["gpt2"])
    torch.manual_seed(0)
    model = GPT(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in (7, 8):
        losses.append(model(tokens[:, :-1], tokens[:, 1:], rng_key=(step, 0)).item())
    assert losses[0] != losses[1]


def test_recompute_off_in_eval_and_no_grad():
    cfg = ModelConfig(**FLAVOURS["llama-gqa"])
    model = GPT(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        plain = model(tokens)
        model.set_recompute("full")
        assert torch.equal(model(tokens), plain)
