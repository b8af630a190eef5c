"""Command line: compose the Hydra config from overrides, validate it, and turn every failure into one line.

We use Hydra's compose API rather than `@hydra.main` so that a bad override can be reported as one line
(key as typed, value, why, fix) before any process group starts, on every rank, with no traceback.
"""

from __future__ import annotations

import os
import sys

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from megatron_lite.config import MODEL_PRESETS, REPO_ROOT, Config, ConfigError, RunError, validate

CONFIG_DIR = os.path.join(REPO_ROOT, "configs")
ConfigStore.instance().store(name="schema", node=Config)


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def _explain(override: str, err: Exception) -> str:
    key, _, value = override.partition("=")
    while err.__cause__ is not None:  # Hydra wraps OmegaConf's precise reason
        err = err.__cause__
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if key.lstrip("+~") == "model" and "model" in first.lower():
        return f"model={value} is not a known preset; use one of {', '.join(MODEL_PRESETS)}"
    if "not in" in first or "Could not override" in first or "Key '" in first:
        group = key.split(".")[0]
        return (f"{key}={value} is not a config key ({first}); "
                f"see README 'Configuration' for the keys of `{group}`")
    return f"{key}={value} is invalid ({first}); see README 'Configuration'"


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose configs/config.yaml with overrides into a typed (structured) config, or raise ConfigError."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"{bad[0]} is not an override; write key=value, e.g. train.steps=100")
    try:
        return _compose(overrides)
    except Exception as err:  # find the override that breaks composition and name it
        for o in overrides:
            try:
                _compose([o])
            except Exception as single:  # noqa: PERF203 - runs only on the error path
                raise ConfigError(_explain(o, single)) from None
        raise ConfigError(f"configuration could not be composed: {str(err).splitlines()[0]}") from None


def load(overrides: list[str], world_size: int | None = None) -> Config:
    """Compose and validate; world_size defaults to torchrun/Slurm's WORLD_SIZE (1 for `python train.py`)."""
    cfg = OmegaConf.to_object(compose_config(overrides))
    cfg.optim.betas = tuple(cfg.optim.betas)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    from megatron_lite.checkpoint_resume import check_resume

    check_resume(cfg, world_size)
    return cfg


def _one_line(message: str, code: int) -> int:
    """Print an error once (on rank 0) and return the exit code: 2 configuration, 3 a run that cannot go on."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: train.py [key=value ...]   e.g. model=gpt2-124m zero.stage=2 train.steps=100\n"
              "       train.py --cfg [key=value ...]   print the composed config and exit\n"
              "       train.py --check [key=value ...]   validate it for WORLD_SIZE ranks and exit (0, or 2)")
        return 0
    mode = argv[0] if argv[:1] in (["--cfg"], ["--check"]) else None
    try:
        cfg = load(argv[1:] if mode else argv)
        if mode == "--cfg":
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        from megatron_lite.deepspeed_config import check_offload_support

        check_offload_support(cfg)
        if mode == "--check":
            return 0
    except ConfigError as err:
        return _one_line(f"config error: {err}", 2)
    import torch.distributed as dist

    from megatron_lite.stalls import collective_timed_out, name_stalled
    from megatron_lite.training import run

    try:
        run(cfg)
    except RunError as err:
        return _one_line(f"error: {err}", 3)
    except RuntimeError as err:  # a collective's timeout: name the rank that stalled, then end like a crash
        if not (dist.is_initialized() and collective_timed_out(err)):
            raise
        reporter, message = name_stalled(grace_s=min(2 * cfg.dist.step_timeout_s, 120))
        if dist.get_rank() == reporter:
            print(f"error: {message}", file=sys.stderr, flush=True)
        return 4
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
