"""One model replica's DeepSpeed engine and the step glue around it.

DeepSpeed owns the optimizer (AdamW), ZeRO partitioning (stages 0-3), CPU/NVMe offload, mixed precision,
gradient reduction and clipping. We own the micro-batch loop, which is the pipeline executor at every pp
(pipeline/executor.py): DeepSpeed is configured with one accumulation step and unmanaged accumulation
(engine/ds_config.py), so each chunk's backward (`output.backward(grad)` through the engine's forward) only
accumulates, the loss carries the 1/m scale, and `step()` after the whole schedule is the one accumulation
boundary. Where DeepSpeed 0.19 needs help, engine/repairs/ says why.

Left out on purpose: fp16 with loss scaling (bf16 covers every GPU this targets), DeepSpeed's own
PipelineEngine (our pipeline runs chunks through this engine instead).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import shutil
from dataclasses import dataclass

import torch

from megatron_lite.config import ModelConfig, TrainConfig
from megatron_lite.data import documents
from megatron_lite.engine import ds_checkpoint
from megatron_lite.engine.ds_config import nvme_swap_dir, param_groups, universal_split_patterns
from megatron_lite.engine.repairs import (
    forget_run_in_deepspeed_globals,
    honour_explicit_zero3_dtype,
    hybrid,
    nvme_checkpoint,
    replay_cpu_adam_beta_powers,
    reset_backward_hook_count,
    restore_group_hyperparameters,
    sum_zero3_gradients_over_cp,
    takes_output_backward,
    universal_load,
    use_hpz_group,
    zero_offload_accumulators,
)
from megatron_lite.layout import Layout
from megatron_lite.model.tied import needs_tie
from megatron_lite.parallel import weight_grad
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.pipeline.executor import PipelineExecutor
from megatron_lite.pipeline.partition import stage_owner
from megatron_lite.pipeline.schedules import SPLIT_BACKWARD


@dataclass
class StepOutcome:
    loss: float  # the step's mean loss over the global batch (same on every rank)
    grad_norm: float  # before clipping; inf or nan on a skipped step
    skipped: bool  # the loss or the gradient norm was not finite: no update happened on any rank
    attended: int | None = None  # data.document_mask: sum over its documents of length squared (MFU's attention)


class Engine:
    """One model replica's DeepSpeed engine plus the pipeline executor that runs its micro-batches."""

    def __init__(
        self,
        model: torch.nn.Module,
        ctx: ParallelContext,
        layout: Layout,
        ds_config: dict,
        *,
        model_cfg: ModelConfig,
        train: TrainConfig,
    ):
        """layout: the run's Layout, built once (its precision and schedule resolved). ds_config: DeepSpeed's
        config for it (engine/ds_config.deepspeed_config: the optimizer and ZeRO groups translated), the one a
        ZeRO-3 model was partitioned with as it was built (engine/zero_init.py). model_cfg: the model group (the
        pipeline's message shape, the universal checkpoint's split patterns); train: the train group (grad_clip)."""
        import deepspeed

        self.ctx, self.layout, self.ds_config = ctx, layout, ds_config
        self.model_cfg, self.grad_clip = model_cfg, train.grad_clip
        if layout.offload_param == "nvme":
            honour_explicit_zero3_dtype()
        if ctx.hpz_group is not None:
            use_hpz_group(ctx.hpz_group)
        self.accum = self.layout.accumulation  # micro-batches per step on each pipeline
        assert model.tied is not None or not needs_tie(model), "a pipeline's tied embedding: see tie_across_stages"
        # The DeepSpeed engine (optimizer, ZeRO, checkpoints) and the model it wraps (this rank's GPT).
        self.ds_engine, _, _, _ = deepspeed.initialize(
            model=model.to(ctx.device),
            model_parameters=param_groups(model, ds_config["optimizer"]["params"]["weight_decay"]),
            config=ds_config,
            mpu=ctx.mpu(),
            dist_init_required=False,
        )
        self.model = self.ds_engine.module
        if layout.zero_stage == 3:
            sum_zero3_gradients_over_cp(self.optimizer, ctx.cp_size)
        if ctx.replica_group is not None:  # hybrid sharding: DeepSpeed sees one replica (engine/repairs/hybrid.py)
            hybrid.average_over_replicas(self.optimizer, ctx.replica_group, ctx.replicas)
            hybrid.write_once_per_replica(self.ds_engine, ctx.replica_rank)
        # Activations (and pipeline messages): bf16 where DeepSpeed holds bf16 parameters; under ZeRO-0's
        # autocast the residual stream stays fp32 (embeddings and norms are fp32 ops there).
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        # Every hyperparameter of this run's optimizer groups (not the learning rate, set each step), put back after a
        # load: a checkpoint of another optimizer (torch's AdamW, saved without offload, into DeepSpeed's CPU Adam)
        # lacks some (bias_correction: a KeyError at the first step).
        self._group_hparams = [
            {k: v for k, v in g.items() if k not in ("params", "lr", "step")} for g in self.optimizer.param_groups
        ]
        # ZeRO optimizers take `output.backward(grad)` through the engine's forward (its hooks open and close
        # each backward). DeepSpeed's plain ZeRO-0 optimizer does not, so there the chunks run the module
        # directly, gradients accumulate in .grad, and we average, measure and clip them before the step.
        self._zero_backward = takes_output_backward(self.ds_engine)
        assert self._zero_backward == (layout.zero_stage > 0), (layout.zero_stage, type(self.optimizer))
        assert self._zero_backward or all(g["fused"] for g in self.optimizer.param_groups), (
            "ZeRO-0 steps with torch's fused AdamW (ds_config; Engine._step_clipped_unless_nonfinite)"
        )
        forward = self.ds_engine if self._zero_backward else self.model
        if not self._zero_backward:
            self.ds_engine.enable_backward_allreduce = False
        autocast = layout.precision == "bf16" and not self.ds_config["bf16"]["enabled"]  # ZeRO-0 bf16
        self.forward = _bf16_autocast(forward, ctx.device.type) if autocast else forward
        # Under autocast a step casts each weight to bf16 once, for all its micro-batches (weight_grad.py)
        self._weight_copies = weight_grad.one_copy_per_step if autocast else contextlib.nullcontext
        # Zero-bubble schedules run forwards and B's on the module itself: a B touches no parameter
        # (parallel/weight_grad.py), and ZeRO's backward epilogue fails on a backward that reduced nothing.
        # Their W's, which accumulate the gradients, go through the engine's forward as every backward above.
        self.split_forward = _bf16_autocast(self.model, ctx.device.type) if autocast else self.model
        self.tied = model.tied
        s_local = model_cfg.seq_len // ctx.cp_size  # pipeline messages hold this rank's share of the sequence
        s_local = s_local // ctx.tp_size if layout.sp else s_local
        self.executor = PipelineExecutor(
            model.chunks,
            layout.schedule,
            ctx.pp_size,
            ctx.pp_rank,
            (layout.micro_batch_size, s_local, model_cfg.d_model),
            self.dtype,
            ctx.device,
            ctx.pp_global_rank,
            ctx.pp_group,
        )
        self.last_stats = None  # the executor's StepStats of the last training step (timings for the bubble)

    @property
    def optimizer(self):
        return self.ds_engine.optimizer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micro_batches: list[torch.Tensor], lr: float, step: int) -> StepOutcome:
        """Run the schedule over every micro-batch, then one optimizer step unless the loss or the gradient
        norm is not finite. `step` keys the dropout masks with each micro-batch's place in the global batch
        (micro-batch j of DP rank r is j·dp + r, the sampler's order), so they do not depend on the layout."""
        assert len(micro_batches) == self.accum, (len(micro_batches), self.accum)
        counts = documents.normalise(micro_batches, self.ctx)  # data.document_mask: the loss's denominator
        attended = counts[1] if counts is not None else None
        dp, dp_rank = self.ctx.dp_size, self.ctx.dp_rank
        rng_keys = [(step, j * dp + dp_rank) for j in range(len(micro_batches))]
        if not self.model.training:  # (eval_loss switches back; walking every module each step cost 0.5 ms)
            self.ds_engine.train()
        self.set_lr(lr)
        zero_offload_accumulators(self.optimizer)
        split = self.executor.schedule_name in SPLIT_BACKWARD
        with self._weight_copies():
            stats = self.executor.run(
                self.split_forward if split else self.forward,
                micro_batches,
                before_backward=self._new_backward,
                rng_keys=rng_keys,
                weight_forward=self.forward,
            )
            if self.tied is not None:
                self._new_backward()
                self.tied.sync(self.forward)
        self.last_stats = stats
        # The loss, summed over cp, averaged over DP (and broadcast over the pipeline), and the gradient norm are the
        # same numbers on every rank, so each rank reaches the same skip decision without another collective.
        loss = self._dp_sum(self._pipeline_loss(stats.loss))
        if self._zero_backward:
            # DeepSpeed's ZeRO and bf16 optimizers compute the norm inside step() and, when it is not finite,
            # clear the gradients and leave parameters and optimizer state untouched (their overflow check).
            # A non-finite loss always makes a non-finite gradient, so the norm decides.
            self.ds_engine.step()
            grad_norm = float(self.ds_engine.get_global_grad_norm())
            loss = loss.item() / self.ctx.dp_size
            return StepOutcome(loss, grad_norm, not math.isfinite(grad_norm), attended)
        if self.ctx.dp_size * self.ctx.cp_size > 1:  # one replica: the average is the gradient itself
            # DP average (and cp sum) of .grad, as DeepSpeed's boundary would do. It flattens every
            # gradient into one buffer, scales it and copies it back: 3 passes over them, 8 ms a step at
            # gpt-1.3b on an H200 even with nothing to reduce.
            self.ds_engine.buffered_allreduce_fallback()
        grad_norm = self._reduced_grad_norm()
        self._step_clipped_unless_nonfinite(loss, grad_norm)
        loss, grad_norm = torch.stack([loss.double(), grad_norm]).tolist()  # the step's one wait for the device
        loss /= self.ctx.dp_size
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        return StepOutcome(loss, grad_norm, not finite, attended)

    def dp_mean(self, value: torch.Tensor) -> float:
        """Mean over the data-parallel replicas of a per-replica scalar of which each cp rank holds a share
        (a loss: see GPT.forward): one sum over dp x cp, divided by dp."""
        return self._dp_sum(value).item() / self.ctx.dp_size

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over dp x cp, on the device (nothing waits for it)."""
        value = value.detach().clone()
        if self.ctx.dp_size * self.ctx.cp_size > 1:
            torch.distributed.all_reduce(value, group=self.ctx.dp_cp_group)
        return value

    def _new_backward(self) -> None:
        if self._zero_backward:  # a ZeRO optimizer behind the engine's forward
            reset_backward_hook_count(self.optimizer)

    def _pipeline_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last virtual stage's mean loss, on every pipeline rank (for logging)."""
        pp, vpp = self.ctx.pp_size, self.layout.vpp
        if pp == 1:
            return loss
        out = loss.detach().clone() if loss is not None else torch.zeros((), device=self.ctx.device)
        head_rank, _ = stage_owner(pp * vpp - 1, pp, v_shape=self.layout.v_shape)  # in a V: rank 0
        torch.distributed.broadcast(out, self.ctx.pp_global_rank(head_rank), group=self.ctx.pp_group)
        return out

    def _step_clipped_unless_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """ZeRO-0's optimizer step, decided on the device: torch's fused AdamW divides every gradient by
        `grad_scale` and, where `found_inf` is 1, leaves parameters, moments and step count untouched (the
        attributes torch's GradScaler sets). So the clip (scale by grad_clip / norm when the norm exceeds it, torch's
        and DeepSpeed's rule) costs no pass over the gradients of its own, and the host does not wait for the norm
        before the step: on a GPU the optimizer's launches queue behind the norm instead of after a round trip."""
        optimizer = self.optimizer  # torch's fused AdamW (checked in __init__)
        finite = torch.isfinite(loss).logical_and(torch.isfinite(grad_norm))
        optimizer.found_inf = finite.logical_not().float()
        clip = self.grad_clip
        optimizer.grad_scale = ((grad_norm + 1e-6) / clip).clamp(min=1.0).float() if clip > 0 else None
        try:
            self.ds_engine.step()  # also clears the gradients, skipped or not
        finally:
            del optimizer.found_inf, optimizer.grad_scale

    @functools.cached_property
    def _norm_params(self) -> list[torch.nn.Parameter]:
        """The parameters the gradient norm counts (_reduced_grad_norm): fixed once built, so found once rather
        than by a walk of every parameter each step."""
        from deepspeed.runtime.utils import is_model_parallel_parameter

        return [
            p
            for p in self.model.parameters()
            if not getattr(p, "ds_pipe_replicated", False) and (is_model_parallel_parameter(p) or self.ctx.tp_rank == 0)
        ]

    def _reduced_grad_norm(self) -> torch.Tensor:
        """The global gradient norm, a float64 scalar on the device (nothing waits for it). DeepSpeed records
        the norm only for its ZeRO/bf16 optimizers; for plain ZeRO-0 we compute the same quantity ourselves,
        after the DP average and before the clip. Squares are summed
        in float64 (as ZeRO does): a float32 norm of a 1M-element gradient on CPU is off by ~1e-5 relative.
        TP-replicated parameters (norm gains, row-parallel biases) count on TP rank 0 only, the last stage's
        tied embedding copy not at all (its twin on the first stage counts). Each norm reads the fp32 gradient
        once and accumulates in float64 (no float64 copy of the gradient: that cost gpt-1.3b 17 ms a step).
        One foreach call: on CUDA a few fused launches (per-tensor launches cost gpt-1.3b 3.9 ms a step on an
        H200); on CPU it is the per-tensor vector_norm, bit for bit."""
        grads = [p.grad.detach() for p in self._norm_params if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if grads:
            squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
        if self.ctx.tp_size * self.ctx.pp_size > 1:
            torch.distributed.all_reduce(squares, group=self.ctx.mp_group)
        return squares.sqrt()

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Mean loss over micro_batches, forward only through the pipeline (data.document_mask: over the labels
        that all of them, on every dp rank, predict)."""
        documents.normalise(micro_batches, self.ctx)
        self.ds_engine.eval()
        loss = self._pipeline_loss(self.executor.run(self.forward, micro_batches, train=False).loss)
        self.ds_engine.train()
        return loss

    def save(self, root: str, tag: str) -> None:
        """Every rank writes its own shards into root/tag (DeepSpeed's layout); no `latest` is touched."""
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # The universal-format description lets a later job with another layout convert this checkpoint.
        info = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            **universal_split_patterns(self.model_cfg, self.ctx.tp_size),
        }
        self.ds_engine.save_checkpoint(root, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: info}, save_latest=False)

    def save_staged(self, root: str, tag: str, copy) -> list[tuple[str, object]]:
        """What save would write into root/tag, as (path, copy(state)) pairs instead (checkpoint.async_save:
        copy takes each state to host memory, and a background thread writes them)."""
        staging, kept = ds_checkpoint.staging_engine(copy), self.ds_engine.checkpoint_engine
        self.ds_engine.checkpoint_engine = staging
        try:
            self.save(root, tag)
        finally:
            self.ds_engine.checkpoint_engine = kept
        return staging.staged

    @property
    def swaps_optimizer(self) -> bool:
        """Whether the optimizer states are swapped to NVMe (zero.offload_optimizer=nvme)."""
        return nvme_checkpoint.swaps_optimizer(self.ds_engine)

    def swap_record(self, path: str, rank: int) -> tuple[str, dict] | None:
        """Where this rank's record of its NVMe-swapped optimizer states goes in checkpoint `path`, just saved,
        and the record (engine/repairs/nvme_checkpoint.py); None when nothing is swapped."""
        return nvme_checkpoint.record(self.ds_engine, path, rank)

    def load(self, root: str, tag: str) -> None:
        """A DeepSpeed checkpoint written at this layout, through DeepSpeed's own load."""
        path, _ = self.ds_engine.load_checkpoint(
            root, tag=tag, load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(root, tag)}")
        restore_group_hyperparameters(self.optimizer, self._group_hparams)
        replay_cpu_adam_beta_powers(self.optimizer)

    def load_universal(self, zero_dir: str) -> None:
        """The universal form's full tensors in `zero_dir` (a checkpoint of any layout, stage or precision), by our
        loader for this ZeRO stage (engine/repairs/universal_load.py)."""
        universal_load.load_into(self, zero_dir, self.layout.zero_stage)
        replay_cpu_adam_beta_powers(self.optimizer)

    def load_swapped(self, path: str, rank: int) -> None:
        """A checkpoint of this layout whose optimizer was swapped to NVMe, as this one's is: every sub-group from
        this rank's own files (engine/repairs/nvme_checkpoint.py)."""
        universal_load.load_offloaded(self, path, rank)
        replay_cpu_adam_beta_powers(self.optimizer)

    def close(self) -> None:
        self.ds_engine.destroy()
        forget_run_in_deepspeed_globals(self.model, self.ctx)
        swapped = nvme_swap_dir(self.ds_config)
        if swapped is not None:
            _remove_own_swap_files(swapped, self.ctx.rank)


def _remove_own_swap_files(folder: str, rank: int) -> None:
    """This rank's NVMe swap files (DeepSpeed's <folder>/zero_stage_3/<kind>/rank<r>; a checkpoint keeps copies of
    the optimizer's), and the folders left empty: a run's swap files are as large as its optimizer states."""
    for own in glob.glob(os.path.join(folder, "zero_stage_3", "*", f"rank{rank}")):
        shutil.rmtree(own, ignore_errors=True)
        kind = os.path.dirname(own)
        for empty in (kind, os.path.dirname(kind), folder):  # not above: zero.nvme_path is the user's
            try:
                os.rmdir(empty)
            except OSError:  # another rank's files are still there
                break


def _bf16_autocast(forward, device_type: str):
    """forward under torch.autocast(bf16): matmuls in bf16 on fp32 parameters, so backward leaves fp32 .grad."""

    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    return run
