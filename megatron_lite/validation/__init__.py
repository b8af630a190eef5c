"""Every check of a composed configuration, before any process group starts: `check(cfg, world_size)` runs them
in order and raises `ConfigError` with one line that names the key as typed, the value, why it is wrong and a fix.

  validate(cfg, world_size)    the config alone: shapes, layout, ZeRO, batch, optimizer, data, logging
  check_offload_support(cfg)   this machine: NVMe offload needs DeepSpeed's async-io op
  check_resume(cfg)            the checkpoint a resume would load (checkpoint/resume.py, which knows the files)

`notes(cfg)` lists settings that are valid but do nothing or less than they seem to; the run prints them as
warnings (so does --check).

Deeper layers keep their invariants as asserts; where a rule belongs to a module's own arithmetic (a pipeline's
layers per stage, a schedule's chunk count) that module raises the ConfigError and validate calls it.
"""

from __future__ import annotations

from megatron_lite.config import Config, data_paths
from megatron_lite.validation.cluster import check_cluster
from megatron_lite.validation.data import check_data
from megatron_lite.validation.model import check_model
from megatron_lite.validation.parallel import check_context_parallel, check_grid, check_pipeline
from megatron_lite.validation.rules import has_gpu
from megatron_lite.validation.run import check_faults, check_run
from megatron_lite.validation.train import check_optim, check_train
from megatron_lite.validation.zero import check_hpz, check_offload_support, check_shard_size, check_zero


def check(cfg: Config, world_size: int) -> None:
    """Everything that can be checked before a process group or a model exists (raises ConfigError)."""
    from megatron_lite.checkpoint.resume import check_resume

    validate(cfg, world_size)
    check_offload_support(cfg)
    check_resume(cfg)


def notes(cfg: Config) -> list[str]:
    """Valid settings that do nothing or less than they seem to, one line each (key, value, what happens)."""
    t, o, out = cfg.train, cfg.optim, []
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        out.append("parallel.sp=true does nothing at parallel.tp=1 (it splits the sequence over the TP ranks)")
    if cfg.parallel.pp == 1 and cfg.parallel.schedule != "auto":  # (zb_h1 and zbv at pp=1 are refused)
        out.append(
            f"parallel.schedule={cfg.parallel.schedule} does nothing at parallel.pp=1 (it orders a pipeline's "
            "micro-batches)"
        )
    if o.warmup_steps > t.steps:
        out.append(
            f"optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the run ends in its warmup, at a "
            f"learning rate of {o.lr * t.steps / o.warmup_steps:.3g} (optim.lr={o.lr})"
        )
    if t.eval_per_dataset and len(data_paths(cfg.data.path)) == 1:
        out.append("train.eval_per_dataset=true does nothing with one data.path (val_loss is that dataset's)")
    if t.profile_steps is not None and t.profile_steps[1] > t.steps:
        out.append(
            f"train.profile_steps={list(t.profile_steps)} ends after train.steps={t.steps}: the profile "
            "stops at the last step"
        )
    if t.recompute_every != 1 and t.recompute != "full":
        out.append(
            f"train.recompute_every={t.recompute_every} does nothing without train.recompute=full (it is {t.recompute})"
        )
    if t.fp8 != "none" and not has_gpu():
        out.append(
            f"train.fp8={t.fp8} on this machine (no GPU) runs torchao's emulation of float8 matmuls: float8's "
            "numerics at fp32's speed, for tests"
        )
    if t.eval_interval > t.steps:
        out.append(f"train.eval_interval={t.eval_interval} > train.steps={t.steps}: this run never evaluates")
    return out


def validate(cfg: Config, world_size: int) -> None:
    """Check cfg for this world size, group by group; raise ConfigError with a one-line explanation on the first
    problem."""
    p = cfg.parallel
    check_model(cfg.model)
    check_grid(cfg, world_size)
    check_context_parallel(cfg, world_size)
    check_cluster(cfg.cluster)
    dp = world_size // (p.tp * p.cp * p.pp)
    check_pipeline(cfg, dp)
    check_zero(cfg.zero)
    check_hpz(cfg, dp)
    check_shard_size(cfg, dp)
    check_train(cfg, world_size, dp)
    check_optim(cfg.optim)
    check_data(cfg)
    check_run(cfg)
    check_faults(cfg)
