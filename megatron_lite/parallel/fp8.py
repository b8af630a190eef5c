"""train.fp8: a projection's three matmuls in float8, through torchao's float8 training (torchao.float8).

torchao does all of the float8 work, as torchtitan uses it: it scales each operand dynamically from its own amax
(`tensorwise`: one scale per tensor; `rowwise`: one per row of each GEMM operand, scales rounded to powers of
two), casts it (e4m3; tensorwise's output gradients e5m2) and multiplies with torch._scaled_mm, or, off CUDA,
emulates _scaled_mm in high precision from the float8 values: float8's numerics at fp32's speed, which is how the
tests run on a CPU. Nothing here scales, casts or multiplies. `Float8Matmul` holds one recipe's torchao
configuration, built as torchao's `Float8Linear` builds it, and runs torchao's autograd function
(`matmul_with_hp_or_float8_args`, the one Float8Linear calls): its forward, and its backward on the tensors it
would have saved.

Why not torchao's module swap (`convert_to_float8_training`): it swaps nn.Linear modules, and our tensor-parallel
projections are not nn.Linear (parallel/layers.py). Here every converted projection, serial or sharded, calls
`linear` below, so each TP shard scales its own operands: a column-parallel shard its rows of W and its own output
gradient, a row-parallel shard its columns of W and its slice of the input. The scales differ from the serial
model's only where a shard's row is shorter than the serial row (tests/distributed/test_fp8.py states how much).

The wrapper (`_Float8Linear`) saves the input and the weight *parameter* for backward, not torchao's saved
`weight.t()`: under ZeRO-3 a view of the gathered weight would keep the whole weight alive (and its storage
outside DeepSpeed's bookkeeping) until backward, where DeepSpeed gathers the parameter again anyway. Under
sequence parallelism the column-parallel projection keeps only its sequence shard and gathers it again in
backward, exactly as in bf16 (layers._SequenceGatherLinear calls `forward` and `backward` here).

Not composed: zero-bubble schedules (torchao's backward makes the input and weight gradients in one call, so W
cannot be deferred: refused in validation/train.py).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch

RECIPES = ("tensorwise", "rowwise")
CHOICES = ("none", *RECIPES)
ALIGN = 16  # torch._scaled_mm's requirement on both dimensions of a weight; other projections stay high precision


def _import_quietly() -> None:
    """Import torchao without its warnings about the compiled extensions of other features (mx formats, CUTLASS
    kernels) that a build of torch other than the wheel's cannot load: float8 training uses none of them."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@dataclasses.dataclass(frozen=True)
class Float8Matmul:
    """One recipe's torchao float8 configuration: `linear(x, W, b)` = x W^T + b with float8 GEMMs."""

    recipe: str
    emulate: bool
    config: Any  # torchao.float8.Float8LinearConfig
    mm_config: Any  # torchao.float8.float8_training_tensor.LinearMMConfig

    @classmethod
    def of(cls, recipe: str, device_type: str) -> Float8Matmul:
        """torchao's recipe; emulated off CUDA (torch._scaled_mm needs a GPU of compute capability 8.9+)."""
        _import_quietly()
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        assert recipe in RECIPES, recipe
        emulate = device_type != "cuda"
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms))
        return cls(recipe, emulate, config, mm)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x W^T in float8, without a graph (x already in the dtype to multiply in)."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        with torch.no_grad():
            return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(dx, dW) of `forward(x, weight)`: torchao's backward, on the tensors its forward would have saved."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        saved = types.SimpleNamespace(
            saved_tensors=(x, weight.t()), config=self.config, linear_mm_config=self.mm_config
        )
        grad_x, grad_w_t, *_ = matmul_with_hp_or_float8_args.backward(saved, grad_out)
        return grad_x, grad_w_t.t()


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Float8Matmul):
        dtype = _autocast_dtype(x.device.type)  # as torchao's Float8Linear: the input in autocast's dtype
        x = x.to(dtype) if dtype is not None else x
        ctx.save_for_backward(x, weight)
        ctx.fp8, ctx.bias_dtype = fp8, bias.dtype if bias is not None else None
        y = fp8.forward(x, weight)
        return y + bias.to(y.dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = ctx.fp8.backward(grad_out, x, weight)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=ctx.bias_dtype) if ctx.bias_dtype else None
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Float8Matmul) -> torch.Tensor:
    """x W^T + b with float8 GEMMs (torchao), gradients to x, W and b."""
    return _Float8Linear.apply(x, weight, bias, fp8)


def converts(in_features: int, out_features: int) -> bool:
    """Whether a projection of this (local) shape multiplies in float8: both dimensions multiples of 16."""
    return in_features % ALIGN == 0 and out_features % ALIGN == 0
