"""The training loop: context -> model -> engine -> (resume) -> steps with metrics, eval and checkpoints.

Stop signals (SIGUSR1 from Slurm's --signal, SIGTERM from a preemption or torchrun) only set a flag; all
ranks agree on it at the next step boundary (a max all-reduce), save a checkpoint and return, so a
requeued or restarted job resumes with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from kernels import resolve_backend
from megatron_lite import checkpoint
from megatron_lite.config import Config, repo_path
from megatron_lite.data.dataset import TokenData, WindowDataset
from megatron_lite.data.sampler import MicroBatches, val_batches
from megatron_lite.engine import Engine, lr_at, resolve_precision
from megatron_lite.metrics import MetricsLogger, peak_flops, step_flops
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.context import ParallelContext, init_distributed
from megatron_lite.parallel.random import TPRNGTracker
from megatron_lite.parallel.tensor_parallel import parallelize


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class StopFlag:
    """Set by SIGUSR1/SIGTERM; read collectively at step boundaries."""

    def __init__(self):
        self.raised = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.raised else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _dp_mean(value: torch.Tensor, ctx: ParallelContext) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, group=ctx.dp_group)
    return value.item() / ctx.dp_size


def run(cfg: Config) -> dict:
    """Train to cfg.train.steps (or until a stop signal). Returns a summary dict (rank 0's view)."""
    init_distributed()
    ctx = ParallelContext.build(cfg.parallel.tp, cfg.parallel.pp)
    stop = StopFlag()
    seed_all(cfg.seed)  # identical initial weights on every rank

    resume_path = checkpoint.resolve_resume(cfg.checkpoint.resume, cfg.checkpoint.dir)
    meta = checkpoint.read_meta(resume_path) if resume_path else None

    model = GPT(cfg.model, tp=ctx.tp_size)
    if meta is not None and meta["kind"] == "weights":
        _, weights = checkpoint.load_model_state(resume_path)
        model.load_state_dict(weights)
    tp_rng = TPRNGTracker(cfg.seed, ctx.tp_rank, ctx.device) if ctx.tp_size > 1 else None
    model = parallelize(model, ctx.tp_group, cfg.parallel.sp, tp_rng)  # shards the full weights: same model as tp=1
    model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
    model.set_kernels(resolve_backend(cfg.kernels.backend, ctx.device))
    universal = meta is not None and checkpoint.needs_universal(meta, ctx.dp_size, ctx.tp_size, cfg.zero.stage)
    engine = Engine(cfg, model, ctx, load_universal=universal)

    start_step, consumed, wandb_id = 0, 0, None
    if meta is not None:
        if meta["kind"] == "deepspeed":
            meta = checkpoint.load(engine, ctx, resume_path, cfg.zero.stage, tp_rng)
        start_step, consumed, wandb_id = meta["step"], meta["consumed_samples"], meta.get("wandb_id")

    data = TokenData(repo_path(cfg.data.path))
    train_set = WindowDataset(data.train, cfg.model.seq_len)
    val_set = WindowDataset(data.val, cfg.model.seq_len) if cfg.train.eval_interval else None
    batches = MicroBatches(train_set, cfg.seed, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                           ctx.dp_rank, ctx.dp_size, consumed)

    logger = MetricsLogger(
        cfg.run.dir, config_dict=asdict(cfg), enabled=ctx.is_first, wandb_mode=cfg.logging.wandb.mode,
        wandb_project=cfg.logging.wandb.project, wandb_entity=cfg.logging.wandb.entity,
        run_name=cfg.run.name or os.path.basename(os.path.normpath(cfg.run.dir)), wandb_id=wandb_id,
        total_steps=cfg.train.steps, log_interval=cfg.train.log_interval,
    )
    dtype = torch.bfloat16 if resolve_precision(cfg) == "bf16" else torch.float32
    peak, peak_source = peak_flops(ctx.device, dtype)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    model_flops, hw_flops = step_flops(cfg.model, tokens_per_step, cfg.train.recompute, cfg.train.recompute_every,
                                       fused_core=ctx.device.type == "cuda" or cfg.model.dropout == 0)
    if start_step:
        logger.print(f"resumed from {resume_path} at step {start_step} ({consumed} samples consumed)")
    if start_step >= cfg.train.steps:
        logger.print(f"nothing to do: {cfg.checkpoint.dir} already holds step {start_step} of train.steps="
                     f"{cfg.train.steps}; raise train.steps, or use another run.dir / checkpoint.resume=never")
    logger.print(f"{cfg.model.name}: world {ctx.world_size} (dp {ctx.dp_size}, tp {ctx.tp_size}, pp {ctx.pp_size}), "
                 f"zero {cfg.zero.stage}, {dtype}, accumulation {engine.accum}, kernels "
                 f"{resolve_backend(cfg.kernels.backend, ctx.device)}; peak {peak / 1e12:.2f} TFLOP/s per device "
                 f"({peak_source})")

    def save(step: int) -> None:
        meta_out = {
            "config": asdict(cfg), "consumed_samples": batches.consumed_samples, "wandb_id": logger.wandb_id,
            "layout": {"world_size": ctx.world_size, "dp": ctx.dp_size, "tp": ctx.tp_size, "pp": ctx.pp_size,
                       "zero_stage": cfg.zero.stage},
        }
        path = checkpoint.save(engine, ctx, cfg.checkpoint.dir, step, meta_out, cfg.checkpoint.keep, tp_rng)
        logger.print(f"saved {path}")

    losses, grad_norms, step, stopped = [], [], start_step, False
    for step in range(start_step + 1, cfg.train.steps + 1):
        t0, lr = time.perf_counter(), lr_at(step - 1, cfg)
        loss, grad_norm = engine.train_step(batches.next_step(), lr)
        loss = _dp_mean(loss, ctx)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": batches.consumed_samples * cfg.model.seq_len, "tokens_per_s": tokens_per_step / dt,
            "step_time_s": dt, "mfu": model_flops / dt / (ctx.world_size * peak),
            "hfu": hw_flops / dt / (ctx.world_size * peak),
        }
        if val_set is not None and step % cfg.train.eval_interval == 0:
            val = val_batches(val_set, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size, cfg.train.eval_iters)
            record["val_loss"] = _dp_mean(engine.eval_loss(val), ctx)
            record["val_ppl"] = float(np.exp(min(record["val_loss"], 50.0)))
        logger.log(step, record)
        losses.append(loss)
        grad_norms.append(grad_norm)
        stopped = stop.agreed(ctx.device)
        interval = cfg.checkpoint.interval
        if stopped or step == cfg.train.steps or (interval and step % interval == 0):
            save(step)
        if stopped:
            logger.print(f"stop signal: saved at step {step}; resume with checkpoint.resume=auto")
            break
    logger.close()
    engine.close()
    return {"losses": losses, "grad_norms": grad_norms, "last_step": step, "stopped": stopped}
