"""The training loop: context -> model -> engine -> (resume) -> steps with metrics, eval and checkpoints.

Stop signals (SIGUSR1 from Slurm's --signal, SIGTERM from a preemption or torchrun) only set a flag
(faults/stop.py); all ranks agree on it at the next step boundary, save a checkpoint and return, so a requeued or
restarted job resumes with `checkpoint.resume=auto`. A step with a non-finite loss or gradient norm updates
nothing (engine.py); too many in a row end the run (NonFiniteError).
"""

from __future__ import annotations

import functools
import gc
import os
import platform
import random
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from megatron_lite.announce import announce
from megatron_lite.checkpoint.manager import Checkpointer
from megatron_lite.config import Config
from megatron_lite.data.sampler import MicroBatches, open_streams, val_batches
from megatron_lite.engine import Engine, StepOutcome
from megatron_lite.engine.build_locks import clear_stale_build_locks
from megatron_lite.engine.ds_config import deepspeed_config
from megatron_lite.engine.repairs import restore_functional_linear
from megatron_lite.engine.zero_init import zero3_partitioner
from megatron_lite.errors import RunError
from megatron_lite.faults import identity, stalls, stop
from megatron_lite.faults.run_lock import RunDirLock, agree_on_refusal
from megatron_lite.faults.stragglers import StragglerWatch
from megatron_lite.kernels import describe, resolve_backend
from megatron_lite.layout import Layout
from megatron_lite.lr_schedule import lr_at
from megatron_lite.metrics.flops import peak_flops, step_flops
from megatron_lite.metrics.logger import MetricsLogger, git_commit
from megatron_lite.metrics.memory import PeakMemory
from megatron_lite.metrics.profiling import StepProfiler
from megatron_lite.model.build import build_model
from megatron_lite.model.gpt import padded_vocab_size
from megatron_lite.parallel.context import ParallelContext, init_distributed, set_collective_timeout


def _continued_wandb_id(meta: dict | None, run_dir: str) -> str | None:
    """The wandb run a resume continues: the checkpoint's, when it was written by this run.dir. A run started
    from another run's checkpoint (run.dir=runs/branch checkpoint.resume=runs/main/...) is a wandb run of its
    own, or it would log into the other run's history (and rename it)."""
    if not meta or not meta.get("wandb_id"):
        return None
    written_by = meta.get("config", {}).get("run", {}).get("dir")
    same = written_by is not None and os.path.realpath(written_by) == os.path.realpath(run_dir)
    return meta["wandb_id"] if same else None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def val_loss_key(path: str) -> str:
    """The metric of one blended dataset's validation loss: val_loss/<its data.path entry, without a leading />."""
    return "val_loss/" + os.path.normpath(path).lstrip("/")


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def restart_count() -> int:
    """How often this job has been restarted: torchrun's worker-group restarts plus Slurm's requeues."""
    return sum(int(os.environ.get(key, "0") or 0) for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


class NonFiniteError(RunError):
    """train.max_skipped_in_row consecutive steps had a non-finite loss or gradient norm."""


def _evaluates(step: int, t) -> bool:
    """Whether step ends with an evaluation: every train.eval_interval steps, and the last step of a run that
    evaluates at all, so the final weights always have a val_loss (Megatron-LM's end-of-training validation)."""
    return step % t.eval_interval == 0 or (step == t.steps and t.eval_interval <= t.steps)


def _pipeline_bubble(stats, ctx: ParallelContext) -> float | None:
    """The share of the schedule's time that pipeline ranks spent not computing, averaged over the pipeline:
    1 - mean(compute seconds) / (longest schedule), None without a pipeline. Idle time counts wherever it
    falls (waiting for a message, or done early while the last rank finishes). With equal costs its theory
    is b / (1 + b) for the bubble b = (pp-1)/(vpp*m) of the ideal time (docs/pipeline.md)."""
    if ctx.pp_size == 1:
        return None
    mine = torch.tensor([stats.wall_s, stats.busy_s], dtype=torch.float64, device=ctx.device)
    every = [torch.zeros_like(mine) for _ in range(ctx.pp_size)]
    dist.all_gather(every, mine, group=ctx.pp_group)
    every = torch.stack(every)
    return 1.0 - every[:, 1].mean().item() / every[:, 0].max().item()


def _max_over_ranks(value: int, ctx: ParallelContext) -> int:
    out = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def run(cfg: Config, layout: Layout) -> dict:
    """Train to cfg.train.steps (or until a stop signal) at `layout`, resolved once from cfg and the world size
    (cli.resolved). Returns a summary dict (rank 0's view)."""
    summary = _train(cfg, layout)
    gc.collect()  # what is left of the run (reference cycles) still holds its process groups' threads
    return summary


def _train(cfg: Config, layout: Layout) -> dict:
    trainer, lock, refusal = None, None, None
    try:
        if os.environ.get("RANK", "0") == "0":  # global rank 0, before any group: one run per run.dir
            try:
                lock = RunDirLock(cfg.run.dir)
            except RunError as err:
                refusal = err
        clear_stale_build_locks()  # before DeepSpeed loads its ops: a killed build's lock would hang us forever
        init_distributed(cfg.dist.timeout_s)
        identity.publish(dist.get_rank())  # who this rank is, for the reports that name one (faults/identity.py)
        ctx = ParallelContext.build(layout.tp, layout.pp, layout.cp, layout.hpz, layout.shard_size)
        agree_on_refusal(refusal, cfg.run.dir, ctx.device)
        memory = PeakMemory(ctx.device, cfg.train.track_memory)  # before the model: every byte it allocates counts
        try:
            trainer = Trainer(cfg, layout, ctx, memory)
            summary = trainer.fit()
        finally:
            memory.close()
        # A process that trains again must not keep this run's groups. Only after a run that ended well: after
        # an error the process ends, and shutting down a group whose collective failed can hang on NCCL.
        trainer.checkpoints.close()
        ctx.destroy()
        return summary
    except Exception as err:
        if (trainer is not None and trainer.stepped) or not stop.requested():
            raise
        return _interrupted_start_up(err)
    finally:
        if lock is not None:
            lock.release()


def _interrupted_start_up(err: Exception) -> dict:
    """A stop signal sent to the whole process group (Slurm's scancel and preemption, a terminal's Ctrl-C, some
    launchers) also reaches what start-up runs as child processes: the compiler DeepSpeed starts for its CPU
    communication op on a machine's first run, Triton's and Inductor's compilers. Start-up then fails with that
    child's error, e.g. "Error building extension 'deepspeed_shm_comm': ninja: build stopped: interrupted by user"
    when SIGTERM to the group lands during that build (seen, and tested). Nothing has trained, so the run stops as
    a signal during start-up does (exit 0, nothing saved) and says what was cut short; once a step has run, an
    error is a crash whatever signal came with it (the restart resumes from the last checkpoint)."""
    if os.environ.get("RANK", "0") == "0":
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        print(
            f"stop signal during start-up: exiting before the first step (start-up was cut short: {reason}), "
            "nothing saved",
            flush=True,
        )
    return {"losses": [], "grad_norms": [], "last_step": None, "stopped": True}


class Trainer:
    """One rank's run: setup (model, engine, resume, data, logger), then steps with metrics, eval and
    checkpoints, then close. `fit` holds the one try/finally: whatever setup reached is closed however the run
    ends, and a run that ends by an error is marked failed in wandb."""

    def __init__(self, cfg: Config, layout: Layout, ctx: ParallelContext, memory: PeakMemory):
        assert layout.world_size == ctx.world_size, (layout, ctx.world_size)  # built for WORLD_SIZE ranks
        self.cfg, self.layout, self.ctx, self.memory = cfg, layout, ctx, memory
        self.engine: Engine | None = None
        self.logger: MetricsLogger | None = None
        self.checkpoints: Checkpointer | None = None
        self.stragglers: StragglerWatch | None = None
        t = cfg.train
        self.profiler = StepProfiler(t.profile_steps, t.profile_ranks, ctx.rank, cfg.run.dir, ctx.device)
        self.stepped = False  # a training step has started: from here an error is a crash, whatever signal came

    def fit(self) -> dict:
        """Set up, train to cfg.train.steps or a stop signal, close. Returns a summary (rank 0's view)."""
        failed = True
        try:
            self.setup()
            summary = self.train()
            failed = False
            return summary
        finally:
            self.close(failed)

    # --- setup ---

    def setup(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        stop.install()  # train.py installed it before any import; other callers (tests, tools) get it here
        seed_all(cfg.seed)  # the default streams (dropout); weights come from the keyed init, see model/init.py
        self.checkpoints = Checkpointer(cfg, ctx, self.layout)
        f = cfg.faults
        if ctx.world_size > 1 and f.straggler_ratio is not None:  # before the engine: DeepSpeed keeps collectives
            self.stragglers = StragglerWatch(f, ctx.device)
        self.engine = self._build_engine()
        meta = self.checkpoints.load(self.engine)
        self.start_step, consumed = (meta["step"], meta["consumed_samples"]) if meta else (0, 0)
        self.skipped_total = meta.get("skipped_steps", 0) if meta else 0  # non-finite steps so far, resumes included
        wandb_id = _continued_wandb_id(meta, cfg.run.dir)
        self._data(consumed)
        self.logger = MetricsLogger(
            cfg.run.dir,
            config_dict=asdict(cfg),
            enabled=ctx.is_rank0,
            wandb_mode=cfg.logging.wandb.mode,
            wandb_project=cfg.logging.wandb.project,
            wandb_entity=cfg.logging.wandb.entity,
            run_name=cfg.run.name or os.path.basename(os.path.normpath(cfg.run.dir)),
            wandb_id=wandb_id,
            total_steps=cfg.train.steps,
            log_interval=cfg.train.log_interval,
            start_step=self.start_step,
        )
        dtype = torch.bfloat16 if self.layout.precision == "bf16" else torch.float32
        self.peak, peak_source = peak_flops(ctx.device, dtype)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        fused_core = ctx.device.type == "cuda" or cfg.model.dropout == 0
        t = cfg.train  # a step's (model, hardware) FLOPs; with data.document_mask, of its documents (attended=)
        self.step_flops = functools.partial(
            step_flops, cfg.model, self.tokens_per_step, t.recompute, t.recompute_every, fused_core
        )
        self.model_flops, self.hw_flops = self.step_flops()
        # Each torchrun agent counts its own restarts: with several nodes, one restarted for a membership change
        # (not counted) and one whose worker failed differ, and rank 0's alone said 0 after a real restart.
        self.restarts = _max_over_ranks(restart_count(), ctx)
        announce(self, self.checkpoints.resume_path, meta, dtype, peak_source)
        if ctx.is_rank0:  # (the only logger that writes; the commit takes a git call)
            self.logger.describe(
                {
                    "world_size": ctx.world_size,
                    "dp": ctx.dp_size,
                    "tp": ctx.tp_size,
                    "pp": ctx.pp_size,
                    "cp": ctx.cp_size,
                    "accumulation": self.engine.accum,
                    "precision": self.layout.precision,
                    "peak_flops_per_device": self.peak,
                    "peak_source": peak_source,
                    "device": _device_name(ctx.device),
                    "commit": git_commit(),
                    "kernels": describe(resolve_backend(cfg.kernels.backend, ctx.device)),
                }
            )
        self.checkpoints.start(self.logger.print)

    def _build_engine(self) -> Engine:
        """This rank's share of the model (from a weights-only checkpoint when resuming one), in its engine."""
        cfg, ctx = self.cfg, self.ctx
        weights = self.checkpoints.imported_weights(padded_vocab_size(cfg.model, ctx.tp_size))
        ds_config = deepspeed_config(cfg, self.layout)
        partition, build_dtype = None, torch.float32
        if cfg.zero.stage == 3:  # parameters are split over DP as they are built, never whole on a rank
            partition, build_dtype = zero3_partitioner(ds_config, ctx)
        # Only this rank's chunks and TP shards are ever allocated; their values are the tp=1, pp=1 model's.
        model = build_model(cfg, ctx, self.layout, weights=weights, dtype=build_dtype, partition=partition)
        del weights
        model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
        model.set_kernels(resolve_backend(cfg.kernels.backend, ctx.device))
        self.fp8_projections = len(model.set_fp8(cfg.train.fp8, ctx.device.type))
        if cfg.train.compile:
            model.compile_blocks()
        return Engine(model, ctx, self.layout, ds_config, model_cfg=cfg.model, train=cfg.train)

    def _data(self, consumed: int) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.data = open_streams(
            cfg.data.path,
            cfg.data.weights,
            cfg.model.seq_len,
            cfg.seed,
            validation=cfg.train.eval_interval > 0,
            each=cfg.train.eval_per_dataset,
            documents=cfg.data.document_mask,
        )
        self.batches = MicroBatches(
            self.data.train, cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size, consumed
        )

    # --- the loop ---

    def train(self) -> dict:
        """Steps from the one after the resumed one to cfg.train.steps; a stop signal saves and ends the loop."""
        cfg, ctx = self.cfg, self.ctx
        if stop.agreed(ctx.device):  # a signal during start-up: nothing has trained, so nothing to save
            self.logger.print(f"stop signal during start-up: exiting before step {self.start_step + 1}, nothing saved")
            return {"losses": [], "grad_norms": [], "last_step": self.start_step, "stopped": True}
        losses, grad_norms, step, stopped, straggler = [], [], self.start_step, False, None
        in_row = 0  # updates skipped in a row for a non-finite loss or gradient norm (self.skipped_total: in all)
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            self.stepped = True
            with self.profiler.step(step):
                record, outcome = self.step(step)
            self.skipped_total, in_row = self.skipped_total + outcome.skipped, in_row + 1 if outcome.skipped else 0
            record["skipped_steps"] = self.skipped_total
            if self.data.val is not None and _evaluates(step, cfg.train):
                record.update(self.evaluate())
            fatal = bool(outcome.skipped) and in_row >= cfg.train.max_skipped_in_row > 0  # the same on every rank
            if self.stragglers is not None and (step % cfg.train.log_interval == 0 or step == cfg.train.steps):
                straggler = self.stragglers.judge(step, record, self.logger)  # a stop's Report, on every rank
            stopped = not fatal and (straggler is not None or stop.agreed(ctx.device))
            interval = cfg.checkpoint.interval
            if not fatal and (stopped or step == cfg.train.steps or (interval and step % interval == 0)):
                record.update(self.save(step))
            last = stopped or fatal or step == cfg.train.steps
            reason = "straggler" if straggler is not None else "stop signal" if stopped else "end of the run"
            self.checkpoints.after_step(record, last, reason=reason)
            self.logger.log(step, record)
            stalls.note_step(step)
            losses.append(outcome.loss)
            grad_norms.append(outcome.grad_norm)
            if outcome.skipped:
                self.logger.print(
                    f"step {step}: loss {outcome.loss}, grad norm {outcome.grad_norm}: not finite, update "
                    f"skipped on every rank ({in_row} in a row, {self.skipped_total} in all)"
                )
                if fatal:
                    raise NonFiniteError(
                        f"train.max_skipped_in_row={cfg.train.max_skipped_in_row}: "
                        + (f"steps {step - in_row + 1}-{step} all" if in_row > 1 else f"step {step}")
                        + " had a non-finite loss or gradient norm; stopped without saving (the weights are those "
                        f"before step {step - in_row + 1}); resume from the last checkpoint with a lower optim.lr or "
                        "other data"
                    )
            if straggler is not None:
                self.stragglers.say_stopped(straggler, step, cfg.run.dir, self.logger, ctx.is_rank0)
                break
            if stopped:
                self.logger.print(f"stop signal: saved at step {step}; resume with checkpoint.resume=auto")
                break
        summary = {"losses": losses, "grad_norms": grad_norms, "last_step": step, "stopped": stopped}
        return summary if straggler is None else {**summary, "straggler": straggler.slowest_rank}

    def step(self, step: int) -> tuple[dict, StepOutcome]:
        """One optimizer step over the global batch, and its metrics record."""
        cfg, ctx = self.cfg, self.ctx
        self.memory.take()  # mem_peak_gib is this step's: not the evaluation's or the save's before it
        if self.stragglers is not None:
            self.stragglers.start_step()
        t0, lr = time.perf_counter(), lr_at(step - 1, cfg)
        outcome = self.engine.train_step(self.batches.next_step(), lr, step)
        if step == self.start_step + 1:  # start-up and the first step's warm-up are done: a hang now ends the job soon
            set_collective_timeout(cfg.dist.step_timeout_s)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if self.stragglers is not None:  # the run's first step (warm-up, compilation) is no rank's measure
            self.stragglers.end_step(dt, counted=step > self.start_step + 1)
        bubble = _pipeline_bubble(self.engine.last_stats, ctx)
        model_flops, hw_flops = self.model_flops, self.hw_flops
        if outcome.attended is not None:  # data.document_mask: attention within documents only
            model_flops, hw_flops = self.step_flops(attended=outcome.attended)
        record = {
            "step": step,
            "loss": outcome.loss,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "tokens": self.batches.consumed_samples * cfg.model.seq_len,
            "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt,
            "mfu": model_flops / dt / (ctx.world_size * self.peak),
            "hfu": hw_flops / dt / (ctx.world_size * self.peak),
            "skipped_steps": None,
            "restarts": self.restarts,  # skipped_steps: counted by train()
        }
        if bubble is not None:
            record["bubble"] = bubble
        mem_peak = self.memory.take()
        if mem_peak is not None:  # the fullest rank's peak of this step
            record["mem_peak_gib"] = _max_over_ranks(mem_peak, ctx) / 2**30
        return record, outcome

    def evaluate(self) -> dict:
        """Validation loss and perplexity over train.eval_iters global batches (and with train.eval_per_dataset,
        each blended dataset's own loss, val_loss/<path>)."""
        t, ctx = self.cfg.train, self.ctx

        def loss(stream) -> float:
            val = val_batches(stream, t.global_batch_size, t.micro_batch_size, ctx.dp_rank, ctx.dp_size, t.eval_iters)
            return self.engine.dp_mean(self.engine.eval_loss(val))

        val_loss = loss(self.data.val)
        each = {val_loss_key(path): loss(stream) for path, stream in (self.data.val_each or {}).items()}
        return {"val_loss": val_loss, "val_ppl": float(np.exp(min(val_loss, 50.0))), **each}

    # --- checkpoints ---

    def save(self, step: int) -> dict:
        """A checkpoint of this step (checkpoint/manager.py); returns the time it held the loop (and write times)."""
        meta = {
            "config": asdict(self.cfg),
            "consumed_samples": self.batches.consumed_samples,
            "wandb_id": self.logger.wandb_id,
            "layout": self.layout.to_meta(),
            "skipped_steps": self.skipped_total,
        }
        return self.checkpoints.save(self.engine, step, meta)

    # --- close ---

    def close(self, failed: bool = False) -> None:
        """Close the logger (wandb marks a failed run so) and the engine, whatever setup reached, and leave the
        process's torch as the run found it. After a failure an error while closing is only reported: it must not
        hide the error that ended the run."""
        for part, close in (
            (self.stragglers, lambda: self.stragglers.close()),
            (self.profiler, lambda: self.profiler.close()),
            (self.logger, lambda: self.logger.close(failed)),
            (self.engine, lambda: self.engine.close()),
        ):
            if part is None:
                continue
            try:
                close()
            except Exception as err:
                if not failed:
                    raise
                print(f"while closing after an error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        restore_functional_linear()  # a ZeRO-3 run's F.linear must not outlive it
