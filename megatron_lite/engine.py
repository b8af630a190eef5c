"""The DeepSpeed engine: config translation, initialisation with our mpu view, and the step glue.

DeepSpeed owns the optimizer (AdamW), ZeRO partitioning (stages 0-3), CPU/NVMe offload, mixed precision,
gradient reduction and clipping. We own the learning-rate schedule (a pure function of the step, so a
resume needs no scheduler state) and the micro-batch loop, which is the pipeline executor at every pp
(pipeline/executor.py): DeepSpeed is configured with one accumulation step and unmanaged accumulation, so
each chunk's backward (`output.backward(grad)` through the engine's forward) only accumulates, the loss carries
the 1/m scale, and `step()` after the whole schedule is the one accumulation boundary.

Left out on purpose: fp16 with loss scaling (bf16 covers every GPU this targets), DeepSpeed's own
PipelineEngine (our pipeline runs chunks through this engine instead).
"""

from __future__ import annotations

import math
import os

import torch

from megatron_lite.config import Config, ConfigError
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.pipeline.executor import PipelineExecutor
from megatron_lite.pipeline.schedules import resolve_schedule
from megatron_lite.pipeline.tied import TiedEmbedding


def resolve_precision(cfg: Config) -> str:
    if cfg.train.precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return cfg.train.precision


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr at train.steps."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant" or total <= o.warmup_steps:
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if o.decay == "cosine" else 1.0 - progress
    return o.min_lr + (o.lr - o.min_lr) * factor


def _offload(device: str, nvme_path: str, pin: bool) -> dict:
    out = {"device": device, "pin_memory": pin}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def deepspeed_config(cfg: Config, dp_size: int, load_universal: bool = False) -> dict:
    """Translate our config into DeepSpeed's JSON config.

    load_universal: the checkpoint about to be loaded was written with another layout (DP or TP size, ZeRO
    stage), so the engine must read DeepSpeed's universal format, which the checkpoint module prepares.
    """
    t, z, o = cfg.train, cfg.zero, cfg.optim
    precision = resolve_precision(cfg)
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
            zero["offload_optimizer"] = _offload(z.offload_optimizer, z.nvme_path, pin)
        if z.offload_param != "none":
            zero["offload_param"] = _offload(z.offload_param, z.nvme_path, pin)
    ds = {
        # One accumulation step as DeepSpeed sees it: our executor runs all m micro-batches (scaled 1/m at the
        # loss) and calls step() once; DeepSpeed must not rescale each chunk's output gradient by 1/m again.
        "train_batch_size": t.micro_batch_size * dp_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        # Plain ZeRO-0 fp32: we clip (Engine._clip_plain). DeepSpeed's clip_grad_norm_ counts replicated
        # parameters on model-parallel rank 0 only, which under a pipeline drops every later stage's norms
        # and biases, and it counts a pipeline's tied embedding twice.
        "gradient_clipping": 0.0 if z.stage == 0 and precision == "fp32" else t.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                # torch's AdamW on the device; DeepSpeed's CPU Adam when the optimizer is offloaded.
                "torch_adam": not offload_opt,
            },
        },
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds


def tp_universal_patterns(model_cfg, tp: int) -> dict:
    """How each tensor-parallel parameter was split, in DeepSpeed's universal-checkpoint vocabulary, so that
    its converter can merge TP shards and its loader can cut them for another tp (see parallel/layers.py)."""
    if tp == 1:
        return {}
    from dataclasses import asdict

    from deepspeed.checkpoint.constants import (
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        PARAMETER_WITH_SUB_PARAMS,
        SUB_PARAM_SHARD_WIDTHS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        VOCABULARY_PARAMETER_PATTERNS,
    )
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    h, hd = model_cfg.d_model, model_cfg.head_dim
    segments = {r"blocks\.\d+\.attn\.qkv": (model_cfg.n_heads * hd, model_cfg.kv_heads * hd, model_cfg.kv_heads * hd)}
    if model_cfg.activation == "swiglu":
        segments[r"blocks\.\d+\.mlp\.fc_in"] = (model_cfg.ffn, model_cfg.ffn)
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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (weights, embeddings), not vectors (biases, norm gains). A parameter that
    ZeRO-3 partitioned while it was built holds an empty 1-D tensor; its true shape is `ds_shape`."""
    def is_matrix(p) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for p in model.parameters() if p.requires_grad and is_matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not is_matrix(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_offload_support(cfg: Config) -> None:
    """NVMe offload needs DeepSpeed's async-io op; say so before any process group starts."""
    z = cfg.zero
    if "nvme" in (z.offload_optimizer, z.offload_param):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            key = "zero.offload_optimizer" if z.offload_optimizer == "nvme" else "zero.offload_param"
            raise ConfigError(f"{key}=nvme needs DeepSpeed's async_io op, which cannot build here (libaio missing); "
                              "install libaio-dev (apt) or use cpu offload")


def honour_explicit_zero3_dtype() -> None:
    """DeepSpeed 0.19's zero.Init ignores the dtype it is given when the accelerator reports no fp16 support
    (the CPU accelerator): `dtype or fp16 if fp16_supported() else bf16 if ...` parses as
    `(dtype or fp16) if ... else bf16`. With NVMe parameter offload the swap buffers then hold bf16, so every
    swapped (non-persistent) fp32 parameter comes back rounded to bf16 (measured: the tiny model's embedding,
    off by up to 2.4e-4 after engine init). Give an explicit dtype precedence, as intended."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "honours_dtype", False):
        return

    def set_dtype(self, ds_config, dtype):
        if dtype is not None:
            self.dtype = dtype
        else:
            original(self, ds_config, dtype)

    set_dtype.honours_dtype = True
    Init._set_dtype = set_dtype


class Engine:
    """One model replica's DeepSpeed engine plus the pipeline executor that runs its micro-batches."""

    def __init__(self, cfg: Config, model: torch.nn.Module, ctx: ParallelContext,
                 load_universal: bool = False):
        import deepspeed

        self.cfg, self.ctx = cfg, ctx
        if cfg.zero.offload_param == "nvme":
            honour_explicit_zero3_dtype()
        self.ds_config = deepspeed_config(cfg, ctx.dp_size, load_universal)
        t = cfg.train
        self.accum = t.global_batch_size // (t.micro_batch_size * ctx.dp_size)  # micro-batches per step
        if ctx.pp_size > 1 and cfg.model.tie_embeddings and model.wte is not None:  # first and last stage
            model.tied = TiedEmbedding(model.wte.weight, ctx.embed_group, is_head_copy=ctx.pp_rank == ctx.pp_size - 1)
        self.module, _, _, _ = deepspeed.initialize(
            model=model.to(ctx.device),
            model_parameters=param_groups(model, cfg.optim.weight_decay),
            config=self.ds_config,
            mpu=ctx.mpu(),
            dist_init_required=False,
        )
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        self._group_hparams = [{k: g[k] for k in ("weight_decay", "betas", "eps")} for g in self.optimizer.param_groups]
        self._plain_optimizer = cfg.zero.stage == 0 and self.dtype == torch.float32
        # ZeRO optimizers take `output.backward(grad)` through the engine's forward (its hooks open and close
        # each backward). DeepSpeed's plain ZeRO-0 optimizer does not, so there the chunks run the module
        # directly, gradients accumulate in .grad, and we average them over DP before the step ourselves.
        self.forward = self.module if self.module._support_torch_style_backward else self.module.module
        if self.forward is self.module.module:
            self.module.enable_backward_allreduce = False
        self.tied = model.tied
        s_local = cfg.model.seq_len // ctx.tp_size if cfg.parallel.sp and ctx.tp_size > 1 else cfg.model.seq_len
        self.executor = PipelineExecutor(model.chunks, resolve_schedule(cfg.parallel.schedule, cfg.parallel.vpp),
                                         ctx.pp_size, ctx.pp_rank, (t.micro_batch_size, s_local, cfg.model.d_model),
                                         self.dtype, ctx.device, ctx.pp_global_rank, ctx.pp_group)
        self.last_stats = None  # the executor's StepStats of the last training step (timings for the bubble)

    @property
    def optimizer(self):
        return self.module.optimizer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> tuple[torch.Tensor, float]:
        """Run the schedule over every micro-batch, then one optimizer step. Returns (the replica's mean loss,
        the same on every pipeline rank; grad norm)."""
        assert len(micro_batches) == self.accum, (len(micro_batches), self.accum)
        self.module.train()
        self.set_lr(lr)
        self._zero_offload_accumulators()
        stats = self.executor.run(self.forward, micro_batches, before_backward=self._new_backward)
        self.last_stats = stats
        if self.tied is not None:
            self._new_backward()
            self.tied.sync(self.forward)
        grad_norm = None
        if self.forward is self.module.module:
            self.module.buffered_allreduce_fallback()  # DP average of .grad, as DeepSpeed's boundary would do
            if self._plain_optimizer:
                grad_norm = self._reduced_grad_norm()
                self._clip_plain(grad_norm)
        self.module.step()
        if grad_norm is None:
            grad_norm = self.module.get_global_grad_norm()
        return self._pipeline_loss(stats.loss), float(grad_norm)

    def _zero_offload_accumulators(self) -> None:
        """With CPU optimizer offload, ZeRO 1/2 copy a parameter's gradient into its CPU accumulator in the
        step's first backward and add to it afterwards, assuming every parameter takes part in the first
        backward. Under a pipeline many do not (a later chunk's first backward, the tied-embedding sync), and
        they would add onto the previous step's gradient. Zeroed buffers make copy and add agree."""
        for buffer in getattr(self.optimizer, "accumulated_grads_in_cpu", {}).values():
            buffer.zero_()

    def _new_backward(self) -> None:
        """DeepSpeed's ZeRO optimizers count gradient hooks per backward and reset the count in the engine's
        forward, assuming a forward before every backward. 1F1B's cool-down runs backwards back to back (and
        the tied-embedding sync runs one more), so reset it before each backward as that forward would;
        otherwise the count runs past the end, the reduction epilogue never runs and ZeRO-2 loses gradients."""
        if self.forward is self.module:
            self.optimizer.clear_backward_seen_flag()

    def _pipeline_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last pipeline stage's mean loss, on every pipeline rank (for logging)."""
        if self.ctx.pp_size == 1:
            return loss
        out = loss.detach().clone() if loss is not None else torch.zeros((), device=self.ctx.device)
        torch.distributed.broadcast(out, self.ctx.pp_global_rank(self.ctx.pp_size - 1), group=self.ctx.pp_group)
        return out

    def _clip_plain(self, grad_norm: float) -> None:
        """Scale every gradient by grad_clip / norm when the norm exceeds it (torch's and DeepSpeed's rule)."""
        clip = self.cfg.train.grad_clip
        coef = clip / (grad_norm + 1e-6)
        if clip > 0 and coef < 1:
            for p in self.module.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    def _reduced_grad_norm(self) -> float:
        """DeepSpeed records the norm only for its ZeRO/bf16 optimizers; for plain ZeRO-0 fp32 we compute the
        same quantity ourselves, after the DP average and before DeepSpeed's clipping. Squares are summed
        in float64 (as ZeRO does): a float32 norm of a 1M-element gradient on CPU is off by ~1e-5 relative.
        TP-replicated parameters (norm gains, row-parallel biases) count on TP rank 0 only, the last stage's
        tied embedding copy not at all (its twin on the first stage counts)."""
        from deepspeed.runtime.utils import is_model_parallel_parameter

        squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for p in self.module.module.parameters():
            if p.grad is None or getattr(p, "ds_pipe_replicated", False):
                continue
            if is_model_parallel_parameter(p) or self.ctx.tp_rank == 0:
                squares += p.grad.detach().double().pow(2).sum()
        if self.ctx.tp_size * self.ctx.pp_size > 1:
            torch.distributed.all_reduce(squares, group=self.ctx.mp_group)
        return squares.sqrt().item()

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Mean loss over micro_batches, forward only through the pipeline."""
        self.module.eval()
        loss = self._pipeline_loss(self.executor.run(self.forward, micro_batches, train=False).loss)
        self.module.train()
        return loss

    def save(self, root: str, tag: str) -> None:
        """Every rank writes its own shards into root/tag (DeepSpeed's layout); no `latest` is touched."""
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, \
            UNIVERSAL_CHECKPOINT_VERSION_VALUE

        # The universal-format description lets a later job with another layout convert this checkpoint.
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                **tp_universal_patterns(self.cfg.model, self.ctx.tp_size)}
        self.module.save_checkpoint(root, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: info},
                                    save_latest=False)

    def load(self, root: str, tag: str) -> None:
        path, _ = self.module.load_checkpoint(root, tag=tag, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(root, tag)}")
        # Two repairs after DeepSpeed 0.19's ZeRO-3 universal load: it copies group 0's hyperparameters into
        # every group (weight decay on biases and norms), and it hands every group the *same* `step` tensor,
        # which torch's AdamW then increments once per group per step (wrong bias correction).
        for group, hparams in zip(self.optimizer.param_groups, self._group_hparams):
            group.update(hparams)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    def close(self) -> None:
        self.module.destroy()
