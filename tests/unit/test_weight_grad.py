"""The B/W split of parallel/weight_grad.py against plain autograd, in one process.

B must leave every parameter untouched (no .grad, no gradient hook: ZeRO reduces in those hooks), W must give
each parameter its gradient once, bitwise what one whole backward gives (the closures are autograd's own
formulas), in fp32 and under bf16 autocast; the executor's zb_h1 at pp=1 (F B W per micro-batch) must equal
1F1B bitwise with and without recomputation (recomputed blocks compute their weight gradients in B)."""

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel import weight_grad
from megatron_lite.pipeline.executor import PipelineExecutor

FLAVOURS = {
    "gpt2": dict(n_heads=4, d_model=32, vocab_size=300, seq_len=16),
    "llama": dict(n_heads=4, n_kv_heads=2, d_model=32, ffn_hidden=48, vocab_size=300, seq_len=16, norm="rmsnorm",
                  activation="swiglu", position="rope", bias=False, tie_embeddings=False),
}


def _model(flavour: str) -> GPT:
    torch.manual_seed(7)
    return GPT(ModelConfig(name=flavour, n_layers=2, **FLAVOURS[flavour]))


def _batch(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_b_then_w_equals_one_backward(flavour, autocast):
    batch = _batch()
    grads = {}
    for split in (False, True):
        model = _model(flavour)
        fired = {name: 0 for name, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: fired.__setitem__(name, fired[name] + 1))
        store = weight_grad.WeightGradStore()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with weight_grad.split(store) if split else torch.enable_grad():
                loss = model(batch[:, :-1], batch[:, 1:])
        if split:
            with store.collecting((0, 0)):
                loss.backward()
            assert all(p.grad is None for p in model.parameters()) and not any(fired.values()), "B touched weights"
            with weight_grad.split(store), store.released((0, 0)):
                out = model(None, chunk=weight_grad.WEIGHT_GRADS)
            out.backward()
            assert store.empty()
        else:
            loss.backward()
        assert all(count == 1 for count in fired.values()), fired  # once each, ZeRO's hooks included
        grads[split] = {name: p.grad for name, p in model.named_parameters()}
    for name, want in grads[False].items():
        assert torch.equal(grads[True][name], want), (name, (grads[True][name] - want).abs().max())


def test_backward_outside_b_is_an_error():
    model = _model("llama")
    batch = _batch()
    with weight_grad.split(weight_grad.WeightGradStore()):
        loss = model(batch[:, :-1], batch[:, 1:])
    with pytest.raises(AssertionError, match="backpropagated outside its B step"):
        loss.backward()


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_zb_h1_at_pp1_equals_1f1b(flavour, recompute):
    batches = [_batch(seed) for seed in range(3)]
    grads = {}
    for schedule in ("1f1b", "zb_h1"):
        model = _model(flavour)
        model.set_recompute(recompute)
        executor = PipelineExecutor(model.chunks, schedule, 1, 0, (2, 16, 32), torch.float32, torch.device("cpu"),
                                    lambda r: r, None)
        loss = executor.run(model, batches).loss
        grads[schedule] = loss, {name: p.grad for name, p in model.named_parameters()}
    assert torch.equal(grads["zb_h1"][0], grads["1f1b"][0])
    for name, want in grads["1f1b"][1].items():
        assert torch.equal(grads["zb_h1"][1][name], want), name
