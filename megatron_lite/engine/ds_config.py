"""Our config -> DeepSpeed's: the JSON config, the optimizer's parameter groups and how the model's parameters are
split over TP ranks, in the words of DeepSpeed's universal checkpoints; and whether DeepSpeed can offload to NVMe
here (validation/zero.py refuses the config before any process group when it cannot).

DeepSpeed runs with one accumulation step and unmanaged accumulation: the pipeline executor runs all m
micro-batches (the loss carries 1/m) and calls step() once (engine.py).
"""

from __future__ import annotations

import os
import zlib

import torch

from megatron_lite.config import Config, ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.model.fused_rows import fused_segments


def holds_bf16(precision: str, zero_stage: int) -> bool:
    """Whether DeepSpeed holds bf16 parameters (and so writes bf16-format states): bf16 on ZeRO 1-3, with fp32
    master weights and fp32 gradient accumulation. DeepSpeed has no fp32-accumulating ZeRO-0 bf16 path, so
    ZeRO-0 bf16 trains fp32 parameters under autocast (engine.py) and its checkpoints are fp32 ones."""
    return precision == "bf16" and zero_stage > 0


def swap_dir(cfg: Config) -> str:
    """Where this run's NVMe swap files go: a folder of zero.nvme_path named after run.dir. DeepSpeed swaps to
    <nvme_path>/zero_stage_3/optimizer/rank<r> (and .../<dtype>params/rank<r>): the same files for every job
    given one nvme_path (the default, /tmp/megatron_lite_nvme, is one for every run on a node), so two runs at once
    swapped each other's optimizer states in and out (measured: losses 2.7 off by step 5, without a word) and
    their checkpoints copied the mix. run.dir holds one run at a time (faults/run_lock.py), so its path keeps the
    runs apart; a restarted run finds its own folder again. Engine.close removes it."""
    run = os.path.realpath(cfg.run.dir)
    return os.path.join(cfg.zero.nvme_path, f"{os.path.basename(run)}-{zlib.crc32(run.encode()):08x}")


def async_io_available() -> bool:
    """Whether DeepSpeed's async I/O op, which NVMe offload needs, can build here (libaio is installed)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def nvme_swap_dir(ds_config: dict) -> str | None:
    """The folder a DeepSpeed config swaps to (swap_dir), None when nothing is offloaded to NVMe."""
    zero = ds_config["zero_optimization"]
    for kind in ("offload_optimizer", "offload_param"):
        if zero.get(kind, {}).get("device") == "nvme":
            return zero[kind]["nvme_path"]
    return None


def _offload(device: str, nvme_path: str, pin: bool) -> dict:
    out = {"device": device, "pin_memory": pin}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def deepspeed_config(cfg: Config, layout: Layout) -> dict:
    """Translate our config, at the run's layout (its dp size and resolved precision), into DeepSpeed's JSON
    config. (A checkpoint of another layout loads through our own loaders of the universal form,
    engine/repairs/universal_load.py, not DeepSpeed's `load_universal`.)"""
    t, z, o = cfg.train, cfg.zero, cfg.optim
    dp_size = layout.zero_dp  # the data-parallel ranks DeepSpeed sees: one ZeRO group (parallel/context.py's mpu)
    bf16_params = holds_bf16(layout.precision, z.stage)
    offload_opt = z.offload_optimizer != "none"
    zero: dict = {"stage": z.stage}
    if z.stage > 0:
        pin = torch.cuda.is_available()
        zero.update(
            contiguous_gradients=True,
            # Unmanaged accumulation allows overlapped reduction only where gradients are partitioned.
            overlap_comm=torch.cuda.is_available() and z.stage >= 2,
            reduce_bucket_size=int(5e7),
            allgather_bucket_size=int(5e7),
        )
        if offload_opt:
            zero["offload_optimizer"] = _offload(z.offload_optimizer, swap_dir(cfg), pin)
        if z.offload_param != "none":
            zero["offload_param"] = _offload(z.offload_param, swap_dir(cfg), pin)
        if z.hpz > 1:
            zero["zero_hpz_partition_size"] = z.hpz  # over ParallelContext.hpz_group (repairs.use_hpz_group)
    ds = {
        # One accumulation step as DeepSpeed sees it: our executor runs all m micro-batches (scaled 1/m at the
        # loss) and calls step() once; DeepSpeed must not rescale each chunk's output gradient by 1/m again.
        "train_batch_size": t.micro_batch_size * dp_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        # ZeRO-0: we clip (Engine._step_clipped_unless_nonfinite). DeepSpeed's clip_grad_norm_ counts replicated
        # parameters on model-parallel rank 0 only, which under a pipeline drops every later stage's norms and
        # biases, and it counts a pipeline's tied embedding twice.
        "gradient_clipping": 0.0 if z.stage == 0 else t.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # torch's AdamW on the device; DeepSpeed's CPU Adam when the optimizer is offloaded.
                "torch_adam": not offload_opt,
                # torch's fused kernel: one pass over parameters, gradients and both moments instead of
                # foreach's several (gpt-1.3b on an H100: the step's optimizer time from 39 ms). ZeRO-0 also
                # clips and skips a non-finite step inside it (Engine._step_clipped_unless_nonfinite); torch
                # has had it on CPU since 2.4.
                **({"fused": True} if not offload_opt else {}),
            },
        },
        # bf16: see holds_bf16 (docs/precision.md, "Mixed precision").
        "bf16": {"enabled": bf16_params},
        **({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"} if bf16_params else {}),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer would synchronize the device at every forward (a module pre-hook, so every
        # micro-batch, even where the chunks bypass the engine) and at step(): the host could not queue a
        # micro-batch's kernels while the previous one ran, and a pipeline's forward would wait on every stream's
        # pending sends. Our loop times the step itself (training.py), with one wait at its end.
        "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
    }
    return ds


def decays(shape) -> bool:
    """Whether AdamW decays a parameter of this shape: matrices (weights, embeddings), not vectors (biases, norm
    gains). param_groups' rule, which a ZeRO-0 checkpoint's conversion also reads its AdamW state by."""
    return len(shape) >= 2


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decayed parameters, then the others (`decays`), each in the model's order. A parameter that
    ZeRO-3 partitioned while it was built holds an empty 1-D tensor; its true shape is `ds_shape`."""

    def is_matrix(p) -> bool:
        return decays(getattr(p, "ds_shape", p.shape))

    decay = [p for p in model.parameters() if p.requires_grad and is_matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not is_matrix(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def universal_split_patterns(model_cfg: ModelConfig, tp: int) -> dict:
    """How each tensor-parallel parameter was split, in DeepSpeed's universal-checkpoint vocabulary, so that
    its converter can merge TP shards and its loader can cut them for another tp (see parallel/layers.py).
    Recorded at tp=1 too: the loader cuts a tensor for a larger tp by what the conversion wrote beside it, and a
    tensor converted without its pattern is cut along dim 0 as one block (fused QKV, row-parallel, vocabulary
    all wrong, silently)."""
    from dataclasses import asdict

    from deepspeed.checkpoint.constants import (
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        PARAMETER_WITH_SUB_PARAMS,
        SUB_PARAM_SHARD_WIDTHS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        VOCABULARY_PARAMETER_PATTERNS,
    )
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    h = model_cfg.d_model
    # Fused tensors with more than one segment (GeLU's fc_in is one segment: a plain column split).
    segments = {
        r"blocks\.\d+\." + module.replace(".", r"\."): tuple(sizes)
        for module, sizes in fused_segments(model_cfg).items()
        if len(sizes) > 1
    }
    sub_params, widths = [], {}
    for prefix, sizes in segments.items():
        for kind in ("weight", "bias") if model_cfg.bias else ("weight",):
            shape = (sizes, h) if kind == "weight" else (sizes,)
            pattern = prefix + r"\." + kind
            sub_params.append(asdict(SubparamShape(patterns=[pattern], shape=shape, partition_dim=0)))
            widths[pattern] = [[size // tp] * tp for size in sizes]
    # DeepSpeed's converter refuses patterns that match nothing, so list only what this model has.
    replicated = [r".*norm.*"]
    replicated += [r"wpe\.weight"] if model_cfg.position == "learned" else []
    replicated += [r".*attn\.proj\.bias", r".*mlp\.fc_out\.bias"] if model_cfg.bias else []
    return {
        TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r".*attn\.proj\.weight", r".*mlp\.fc_out\.weight"],
        VOCABULARY_PARAMETER_PATTERNS: [r"wte\.weight"] + ([] if model_cfg.tie_embeddings else [r"lm_head\.weight"]),
        "original_vocab_size": model_cfg.vocab_size,  # padded rows are dropped and re-padded with zeros
        PARAMETER_WITH_SUB_PARAMS: sub_params,
        SUB_PARAM_SHARD_WIDTHS: widths,
    }
