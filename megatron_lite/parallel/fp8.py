"""train.fp8: a projection's three matmuls in float8, through torchao's float8 training (torchao.float8).

torchao does all of the float8 work, as torchtitan uses it: it scales each operand dynamically from its own amax
(`tensorwise`: one scale per tensor; `rowwise`: one per row of each GEMM operand, scales rounded to powers of
two; `rowwise_with_gw_hp`: rowwise, but the weight gradient's GEMM in high precision), casts it (e4m3;
tensorwise's output gradients e5m2) and multiplies with torch._scaled_mm, or, off CUDA,
emulates _scaled_mm in high precision from the float8 values: float8's numerics at fp32's speed, which is how the
tests run on a CPU. Scales, casts and float8 matmuls are all torchao's functions; `Float8Matmul` holds one recipe's torchao
configuration, built as torchao's `Float8Linear` builds it, and runs torchao's autograd function
(`matmul_with_hp_or_float8_args`, the one Float8Linear calls) for the forward, and its backward's two halves
(`input_grad`, `weight_grad`: torchao's casts of each operand and its float8 matmuls, in the order it makes
them) for the backward, so that a zero-bubble schedule can make the input gradient in B and the weight gradient
in W. The two halves together equal torchao's backward bit for bit (tests/unit/test_fp8.py).

Why not torchao's module swap (`convert_to_float8_training`): it swaps nn.Linear modules, and our tensor-parallel
projections are not nn.Linear (parallel/layers.py). Here every converted projection, serial or sharded, calls
`linear` below, so each TP shard scales its own operands: a column-parallel shard its rows of W and its own output
gradient, a row-parallel shard its columns of W and its slice of the input. The scales differ from the serial
model's only where a shard's row is shorter than the serial row (tests/distributed/test_fp8.py states how much).

The wrapper (`_Float8Linear`) saves the input and the weight *parameter* for backward, not torchao's saved
`weight.t()`: under ZeRO-3 a view of the gathered weight would keep the whole weight alive (and its storage
outside DeepSpeed's bookkeeping) until backward, where DeepSpeed gathers the parameter again anyway. Under
sequence parallelism the column-parallel projection keeps only its sequence shard and gathers it again in
backward, exactly as in bf16 (layers._SequenceGatherLinear calls `forward`, `input_grad` and `weight_grads`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
HIGH_PRECISION_WEIGHT_GRAD = ("rowwise_with_gw_hp",)  # recipes whose weight-gradient GEMM stays in bf16
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


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast multiplies in on this device type, or None outside autocast."""
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

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b, added in the product's dtype) in float8, without a graph (x already in the dtype to
        multiply in)."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        with torch.no_grad():
            y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
            return y + bias.to(y.dtype) if bias is not None else y

    def input_grad(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dx = g W of `forward(x, weight)`, the first half of torchao's backward (B of a zero-bubble step):
        g scaled along its rows' features, W^T along its output features for the input gradient."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        c, g = self.config, grad_out.reshape(-1, grad_out.shape[-1])
        g8 = self._cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1)
        w8 = self._cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1)
        return torch.mm(g8, w8.t()).reshape(*grad_out.shape[:-1], -1)

    def weight_grad(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dW = g^T x (out, in), the second half (W of a zero-bubble step): both scaled along the tokens."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g8 = self._cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0)
        x8 = self._cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0)
        return torch.mm(g8.t(), x8)

    def _cast(self, t: torch.Tensor, cast, role, dim: int) -> torch.Tensor:
        """t as torchao's backward casts it for one GEMM (`cast`: that operand's CastConfig; dim: the axis its
        rowwise scales span)."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

        if cast.scaling_type is ScalingType.DISABLED:
            return t
        return hp_tensor_to_float8_dynamic(
            t,
            cast.target_dtype,
            self.mm_config,
            gemm_input_role=role,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cast.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def weight_grads(
        self, grad_out: torch.Tensor, x: torch.Tensor, param_dtype: torch.dtype, has_bias: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(dW, db): the weight gradient in float8, the bias's summed in the parameters' dtype."""
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=param_dtype) if has_bias else None
        return self.weight_grad(grad_out, x), grad_b


class _Float8Linear(torch.autograd.Function):
    """x W^T + b in float8. In a zero-bubble step (store given) on stand-ins of `weights`: backward returns dx
    (B) and queues (dW, db) against `weights` for W, as weight_grad's _Linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Float8Matmul, store, weights):
        dtype = autocast_dtype(x.device.type)  # as torchao's Float8Linear: the input in autocast's dtype
        x = x.to(dtype) if dtype is not None else x
        ctx.save_for_backward(x, weight)
        ctx.fp8, ctx.has_bias, ctx.param_dtype = fp8, bias is not None, weight.dtype
        ctx.store, ctx.weights = store, weights
        return fp8.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = ctx.fp8.input_grad(grad_out, weight)
        weight_grads = lambda: ctx.fp8.weight_grads(grad_out, x, ctx.param_dtype, ctx.has_bias)  # noqa: E731
        if ctx.store is None:
            return grad_x, *weight_grads(), None, None, None
        ctx.store.defer(ctx.weights, weight_grads)
        return grad_x, None, None, None, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Float8Matmul, store=None, weights=()
) -> torch.Tensor:
    """x W^T + b with float8 GEMMs (torchao), gradients to x, W and b; store, weights: a zero-bubble step's
    WeightGradStore and the parameters that weight and bias stand in for (parallel/weight_grad.py)."""
    return _Float8Linear.apply(x, weight, bias, fp8, store, weights)


def converts(in_features: int, out_features: int) -> bool:
    """Whether a projection of this (local) shape multiplies in float8: both dimensions multiples of 16."""
    return in_features % ALIGN == 0 and out_features % ALIGN == 0
