"""Initial weights as a pure function of (seed, parameter name), and their materialisation from the meta device.

Every full (serial, unsharded) parameter is drawn from its own CPU generator, seeded from the run's seed and the
parameter's global name, one tensor at a time. A parameter's value therefore depends on nothing else: not on
which other parameters this rank holds, not on the order they are built in, not on the global RNG. A pipeline
rank or a TP shard draws the full tensors it needs and keeps its slice, and so starts from exactly the weights
of the single-device model with the same seed.

The rules are GPT-2's: norm gains ones, biases zeros, residual output projections N(0, std / sqrt(2 * n_layers)),
every other matrix N(0, std). Embedding rows past the true vocabulary (the padding that depends on tp) are zero,
so padding for another tp changes no real row.

A module whose parameters are shards of full ones (the TP layers in megatron_lite/parallel/layers.py) says
which part it holds through `shard_of(attr, full)`; the same method slices the weights when a layer is made
from a built module (`from_full`), so there is one slicing rule for both routes.

Left out on purpose: drawing only a shard's elements without the full tensor (torch's CPU generator has no
cheap skip-ahead, and one full tensor at a time is small next to any rank's share).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from megatron_lite.config import ModelConfig

RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.fc_out.weight")
VOCAB_ROWS = ("wte.weight", "lm_head.weight")


def param_seed(seed: int, name: str) -> int:
    """A 64-bit generator seed for one parameter. blake2b, not Python's hash(), which changes with every process
    (PYTHONHASHSEED); 64 bits rather than a CRC's 32, so two names of one model practically never share a stream."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (global name, e.g. `blocks.7.attn.qkv.weight`), on CPU."""
    if len(shape) == 1:  # norm gains and biases
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else cfg.init_std
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    if name in VOCAB_ROWS and shape[0] > cfg.vocab_size:
        out = torch.zeros(shape)
        out[: cfg.vocab_size].normal_(0.0, std, generator=generator)  # (vocab, h): the same rows at every padding
        return out
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def local_part(module: nn.Module, attr: str, full: torch.Tensor) -> torch.Tensor:
    """What `module` holds of the full parameter `attr`: its shard for a sharded layer, else all of it."""
    shard_of = getattr(module, "shard_of", None)
    return shard_of(attr, full) if shard_of is not None else full


def parameter_slots(model: nn.Module):
    """(global name, owning module, attribute) for every parameter of `model`."""
    for prefix, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is not None:
                yield (f"{prefix}.{attr}" if prefix else attr), module, attr


def check_full_weights(weights: Mapping[str, torch.Tensor], full_shapes: Mapping[str, tuple]) -> None:
    """A full state dict must fit the whole serial model (as load_state_dict(strict=True) would demand), even
    though this rank takes only part of it."""
    missing, unexpected = sorted(set(full_shapes) - set(weights)), sorted(set(weights) - set(full_shapes))
    wrong = [
        f"{k}: {tuple(weights[k].shape)} vs model {full_shapes[k]}"
        for k in sorted(set(weights) & set(full_shapes))
        if tuple(weights[k].shape) != tuple(full_shapes[k])
    ]
    if missing or unexpected or wrong:
        raise RuntimeError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shapes {wrong[:5]}"
        )


@torch.no_grad()
def materialize(
    model: nn.Module,
    full_value: Callable[[str], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    partition: Callable[[nn.Parameter], None] | None = None,
) -> None:
    """Replace every parameter still on the meta device by a real one on `device`: the full tensor from
    full_value(name) (a new tensor, which may become the parameter itself), cut to this module's part, cast to
    dtype. One parameter at a time, so the peak is this rank's share plus one full tensor and its part.
    `partition(param)`, if given, runs on each new parameter at once (ZeRO-3 partitioning, model/build.py).
    Attributes set on the meta parameter (TP marks) carry over."""
    for name, module, attr in list(parameter_slots(model)):
        meta = module._parameters[attr]
        if not meta.is_meta:
            continue
        full = full_value(name)
        part = local_part(module, attr, full)
        assert part.shape == meta.shape, (name, tuple(part.shape), tuple(meta.shape))
        if part.untyped_storage().nbytes() > part.numel() * part.element_size():
            part = part.clone()  # a slice (vocabulary rows) would keep the whole full tensor alive
        param = nn.Parameter(part.to(device=device, dtype=dtype), requires_grad=meta.requires_grad)
        param.__dict__.update(meta.__dict__)
        module._parameters[attr] = param
        del full, part
        if partition is not None:
            partition(param)
