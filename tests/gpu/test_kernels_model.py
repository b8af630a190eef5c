"""On CUDA: the whole model with kernels.backend=triton against the torch references, fp32 and bf16, both
flavours, loss and every gradient. (The per-kernel comparisons in tests/unit/test_kernels_*.py also run on
CUDA when it is present: they are parametrized over the device.)"""

import copy

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT

FLAVOURS = {
    "gpt2": dict(n_layers=2, n_heads=6, d_model=384, vocab_size=5003, seq_len=256),
    "llama-gqa": dict(n_layers=2, n_heads=6, n_kv_heads=2, d_model=384, ffn_hidden=1000, vocab_size=5003,
                      seq_len=256, norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                      tie_embeddings=False),
}
# fp32 kernels reorder reductions (1e-4); bf16 activations round differently in fused and unfused code.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_triton_model_matches_torch_model(flavour, dtype):
    torch.manual_seed(0)
    reference = GPT(ModelConfig(**FLAVOURS[flavour])).to("cuda", dtype)
    fused = copy.deepcopy(reference)
    fused.set_kernels("triton")
    tokens = torch.randint(0, 5003, (4, 257), device="cuda")
    losses = []
    for model in (reference, fused):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.float())
    torch.testing.assert_close(losses[1], losses[0], **TOL[dtype])
    fused_params = dict(fused.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(fused_params[name].grad.float(), p.grad.float(), **TOL[dtype], msg=name)
