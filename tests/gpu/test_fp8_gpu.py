"""On CUDA with float8 tensor cores (compute capability 8.9+): train.fp8 through torch._scaled_mm, not the CPU's
emulation. The wrapper (parallel/fp8.py) equals torchao's Float8Linear bit for bit in bf16, both recipes, and
stays near the emulation (the same float8 operands, another accumulation); a model's step in float8 stays near
bf16, eager and compiled."""

import pytest
import torch
import torch.nn as nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.fp8 import RECIPES, Float8Matmul, linear

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="no float8 tensor cores"
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_wrapper_is_torchaos_float8_linear_on_the_gpu(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    full = nn.Linear(1024, 2048, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(4, 256, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fp8 = Float8Matmul.of(recipe, "cuda")
    swapped = Float8Linear.from_float(nn.Linear(1024, 2048, device=DEVICE, dtype=torch.bfloat16), config=fp8.config)
    swapped.weight, swapped.bias = full.weight, full.bias
    outs = []
    for fn in (lambda: linear(x, full.weight, full.bias, fp8), lambda: swapped(x), lambda: full(x)):
        for t in (x, full.weight, full.bias):
            t.grad = None
        y = fn()
        y.float().pow(2).mean().backward()
        outs.append((y.detach(), x.grad.clone(), full.weight.grad.clone()))
    (ours, theirs, exact), emulated = outs, Float8Matmul.of(recipe, "cpu")
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert 5e-3 < _rel(ours[0], exact[0]) < 0.1
    assert _rel(ours[0], emulated.forward(x.detach(), full.weight) + full.bias) < 1e-2


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_float8_step_stays_near_bf16(compile):
    cfg = ModelConfig(n_layers=2, n_heads=8, d_model=512, vocab_size=4096, seq_len=256)
    tokens = torch.randint(0, 4096, (4, 257), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    losses = {}
    for fp8 in ("none", "rowwise"):
        model = GPT(cfg, seed=0, device=DEVICE).to(torch.bfloat16)
        assert len(model.set_fp8(fp8, "cuda")) == (0 if fp8 == "none" else 8)
        if compile:
            model.compile_blocks()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses[fp8] = loss.item()
    assert 0 < abs(losses["rowwise"] - losses["none"]) / losses["none"] < 1e-2
