"""train.fp8 on a CPU, through torchao's emulation of float8 matmuls (the GPU's _scaled_mm is tests/gpu/).

What is ours is which projections convert and the wrapper that runs torchao's function (parallel/fp8.py): its
forward and backward equal torchao's own Float8Linear exactly, in fp32 and under bf16 autocast. Against the high
precision model, float8 moves a projection's output and gradients by a few percent of their size (measured 3.5-5%
on random data; a tiny model's weight gradients 5-10%), and a tiny model's loss by 1e-5 to 1e-4: the checks hold
them to ranges that a projection left in high precision (error 0) or a wrong scale (error ~1) would fail."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.fp8 import RECIPES, Float8Matmul, linear
from tests.unit.test_model import GPT2, LLAMA

torchao_float8 = pytest.importorskip("torchao.float8")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    out.float().pow(2).mean().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_wrapper_is_torchaos_float8_linear(recipe):
    """Output, input, weight and bias gradients bit for bit those of torchao's Float8Linear (its module swap)."""
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    full = nn.Linear(64, 96)
    x = torch.randn(3, 16, 64, requires_grad=True)
    fp8 = Float8Matmul.of(recipe, "cpu")
    swapped = Float8Linear.from_float(nn.Linear(64, 96), config=fp8.config)
    swapped.weight, swapped.bias = full.weight, full.bias
    params = (x, full.weight, full.bias)
    ours, ours_grads = _grads(lambda: linear(x, full.weight, full.bias, fp8), *params)
    theirs, their_grads = _grads(lambda: swapped(x), *params)
    assert torch.equal(ours, theirs)
    for a, b in zip(ours_grads, their_grads):
        assert torch.equal(a, b)
    # and it is float8: a few percent from the fp32 product, in every output and gradient
    exact, exact_grads = _grads(lambda: full(x), *params)
    assert 5e-3 < _rel(ours, exact) < 0.1
    for a, b in zip(ours_grads[:2], exact_grads[:2]):
        assert 5e-3 < _rel(a, b) < 0.1


def test_under_bf16_autocast_the_input_multiplies_in_bf16():
    """ZeRO-0's bf16: fp32 parameters under autocast. The input is cast to bf16 (as torchao's module does on a
    GPU), the weight goes to float8 from fp32, and the weight gradient comes back in fp32."""
    torch.manual_seed(0)
    w = torch.randn(32, 48, requires_grad=True)
    x = torch.randn(2, 16, 48)
    fp8 = Float8Matmul.of("rowwise", "cpu")
    with torch.autocast("cpu", torch.bfloat16):
        y = linear(x, w, None, fp8)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert torch.equal(y, fp8.forward(x.to(torch.bfloat16), w))


def _model(shape: dict, seed: int = 0) -> GPT:
    return GPT(ModelConfig(**shape), seed=seed)


def test_which_projections_convert():
    """Every block's four projections; the embedding and the untied LM head stay high precision; none of a model
    whose widths are not multiples of 16 (torch._scaled_mm); `none` turns them off again."""
    model = _model(LLAMA)
    names = model.set_fp8("rowwise", "cpu")
    assert names == [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.proj", "mlp.fc_in", "mlp.fc_out")]
    assert model.lm_head.fp8 is None and not hasattr(model.wte, "fp8")
    assert all(model.get_submodule(n).fp8.recipe == "rowwise" for n in names)
    assert model.set_fp8("none", "cpu") == [] and all(model.get_submodule(n).fp8 is None for n in names)
    assert _model(dict(GPT2, d_model=40, n_heads=4)).set_fp8("tensorwise", "cpu") == []


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_model_in_fp8_stays_near_high_precision(shape, recipe):
    """One forward and backward of the same weights and tokens: the loss within 1e-3 (relative; measured
    1.2e-5 to 1.4e-4) and every converted projection's weight gradient within 15% (measured 5-10%), and none
    within 1% (float8 is on)."""
    tokens = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(1))
    runs = {}
    for fp8 in ("none", recipe):
        model = _model(shape)
        model.set_fp8(fp8, "cpu")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        runs[fp8] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss, grads), (loss8, grads8) = runs["none"], runs[recipe]
    assert 0 < abs(loss8 - loss) / loss < 1e-3
    projections = [n for n in grads if n.endswith((".qkv.weight", ".proj.weight", ".fc_in.weight", ".fc_out.weight"))]
    assert len(projections) == 8
    for name in projections:
        assert 1e-2 < _rel(grads8[name], grads[name]) < 0.15, name


def test_recipes_are_torchaos():
    """tensorwise: e4m3 forward, e5m2 output gradients; rowwise: e4m3 throughout, power-of-two scales;
    rowwise_with_gw_hp: the weight gradient's operands left in high precision."""
    tensorwise, rowwise, high_precision_gw = (Float8Matmul.of(r, "cpu").config for r in RECIPES)
    assert tensorwise.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert rowwise.cast_config_grad_output.target_dtype == torch.float8_e4m3fn and rowwise.round_scales_to_power_of_2
    assert high_precision_gw.cast_config_grad_output_for_grad_weight.scaling_type.name == "DISABLED"
    assert Float8Matmul.of("rowwise", "cpu").emulate and not Float8Matmul.of("rowwise", "cuda").emulate
    assert dataclasses.replace(rowwise, emulate=False) == Float8Matmul.of("rowwise", "cuda").config
