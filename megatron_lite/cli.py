"""Command line: compose the Hydra config from overrides, validate it, and turn every failure into one line.

We use Hydra's compose API rather than `@hydra.main` so that a bad override can be reported as one line
(key as typed, value, why, fix) before any process group starts, on every rank, with no traceback.
"""

from __future__ import annotations

import atexit
import difflib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from megatron_lite.config import MODEL_PRESETS, REPO_ROOT, Config, ModelConfig
from megatron_lite.errors import ConfigError, RunError
from megatron_lite.layout import Layout
from megatron_lite.validation import check, notes, validate

CONFIG_DIR = os.path.join(REPO_ROOT, "configs")
_ABSENT = object()
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
    if key.startswith("+") and not key.startswith("++"):  # `+` appends; every key of the schema is there already
        return f"{key}={value} adds a key the config already has; write it without the +: {key.lstrip('+')}={value}"
    if key.lstrip("+~") == "model" and "model" in first.lower():
        return f"model={value} is not a known preset; use one of {', '.join(MODEL_PRESETS)}"
    schema = _schema()
    if "not in" in first or "Could not override" in first or "Key '" in first:
        keys = _leaf_keys(OmegaConf.to_container(schema, resolve=False))
        close = difflib.get_close_matches(key.lstrip("+~"), keys, n=1, cutoff=0.8)
        group = key.lstrip("+~").split(".")[0]
        fix = (
            f"did you mean {close[0]}=...?"
            if close
            else f"see README 'Configuration' for the keys of `{group}`"
            if group in schema
            else f"the groups are {', '.join(k for k in schema if OmegaConf.is_dict(schema[k]))} and seed"
        )
        return f"{key}={value} is not a config key ({first}); {fix}"
    default = OmegaConf.select(schema, key.lstrip("+~"), default=_ABSENT, throw_on_missing=False)
    if default is not _ABSENT and default is not None and not OmegaConf.is_config(default):
        from megatron_lite.config import override_value

        return f"{key}={value} is invalid ({first}); give a value of its type, e.g. {key}={override_value(default)}"
    return f"{key}={value} is invalid ({first}); see README 'Configuration'"


def _schema() -> DictConfig:
    """Every key of the config with its default (the model group's from ModelConfig's)."""
    return OmegaConf.structured(Config(model=ModelConfig()))


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """Every overridable key of the schema, dotted."""
    out = []
    for k, v in tree.items():
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose configs/config.yaml with overrides into a typed (structured) config, or raise ConfigError."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"{bad[0]} is not an override; write key=value, e.g. train.steps=100")
    schema = _schema()
    for o in overrides:  # Hydra's `+key=value` adds a key the schema lacks: a typo would be kept and never read
        key, _, value = o.partition("=")
        if key.startswith("+") and OmegaConf.select(schema, key.lstrip("+"), default=_ABSENT) is _ABSENT:
            raise ConfigError(
                f"{key.lstrip('+')}={value} is not a config key (given as {key}={value}; a leading + adds "
                f"keys, and this schema has none to add); see README 'Configuration' for the keys of "
                f"`{key.lstrip('+').split('.')[0]}`"
            )
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
    """Compose and check (validation.check); world_size defaults to torchrun/Slurm's WORLD_SIZE (1 for
    `python train.py`)."""
    return checked(compose_config(overrides), world_size)


def resolved(overrides: list[str]) -> tuple[Config, Layout]:
    """What a run is, resolved once: the checked config and its Layout on WORLD_SIZE ranks (precision and
    pipeline schedule resolved for this machine, layers split over the stages). training.run takes both."""
    cfg = load(overrides)
    return cfg, Layout.of_run(cfg, env_world_size())


def env_world_size() -> int:
    """WORLD_SIZE as torchrun/Slurm set it (1 for `python train.py`); ConfigError when it is not a rank count."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(value)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(
            f"WORLD_SIZE={value} is not a number of ranks (an integer >= 1); unset it for one process, "
            "or export WORLD_SIZE=N to check a layout for N ranks"
        )
    return world


def checked(composed: DictConfig, world_size: int | None = None) -> Config:
    """A composed config as the typed Config, checked (load's second half)."""
    cfg = OmegaConf.to_object(composed)
    cfg.optim.betas = tuple(cfg.optim.betas)
    check(cfg, env_world_size() if world_size is None else world_size)
    return cfg


def _check(cfg: Config, json_path: str | None) -> int:
    """`--check`: the layout's predicted memory, time and MFU in one line; exit 2 if it does not fit."""
    from megatron_lite.plan import cluster_from_config, predict
    from megatron_lite.plan.report import check_line, does_not_fit, write_json
    from megatron_lite.plan.search import fixes

    world = env_world_size()
    c = cfg.cluster
    if c.nodes is not None and world > c.nodes * c.gpus_per_node:
        return _one_line(
            f"config error: cluster.nodes={c.nodes} holds {c.nodes * c.gpus_per_node} GPUs "
            f"(cluster.gpus_per_node={c.gpus_per_node}), fewer than the {world} ranks of WORLD_SIZE; use "
            f"cluster.nodes={-(-world // c.gpus_per_node)}, or leave it null to derive it",
            2,
        )
    cluster = cluster_from_config(c, world)
    prediction = predict(cfg.model, Layout.of_run(cfg, world, cuda=True), cluster)  # as it runs on the cluster
    if json_path:
        write_json(json_path, [prediction])
    if not prediction.fits:
        return _one_line(
            "config error: " + does_not_fit(prediction, cluster, fixes(cfg.model, prediction.layout, cluster)),
            2,
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(check_line(prediction, cluster))
        for note in notes(cfg):
            print(f"warning: {note}")
    return 0


def _plan(overrides: list[str], json_path: str | None) -> int:
    """`--plan`: every layout of the model and batch on the cluster, ranked; the top ones as a table."""
    from megatron_lite.layout import resolve_precision
    from megatron_lite.plan import cluster_from_config
    from megatron_lite.plan.measured import step_error
    from megatron_lite.plan.report import plan_table, write_json
    from megatron_lite.plan.search import PINNABLE, UNSEARCHED, Space, search, why_none

    cfg = OmegaConf.to_object(compose_config(overrides))
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o]
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+")
        if key in UNSEARCHED:
            raise ConfigError(
                f"{key}={value} is not among what --plan searches ({UNSEARCHED[key]}); leave it out, and "
                f"`train.py --check` a layout with it"
            )
    # A searched knob given on the command line pins it: only layouts with that value are ranked.
    given = OmegaConf.structured(cfg)
    pinned = tuple((PINNABLE[key], OmegaConf.select(given, key)) for key in PINNABLE if key in keys)
    for key in ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "train.micro_batch_size"):
        value = OmegaConf.select(given, key)
        if key in keys and value < 1:  # a pin below 1 would read as "no layout has it" below
            raise ConfigError(f"{key}={value} must be >= 1; pin a size of 1 or more, or leave it out to search it")
    # Check what does not depend on the layout (model, batch, cluster, data) with a layout every world admits.
    cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.vpp = cfg.parallel.cp = 1
    cfg.parallel.pp_layers = None
    cfg.train.micro_batch_size = cfg.train.global_batch_size
    validate(cfg, 1)
    cluster = cluster_from_config(cfg.cluster)
    space = Space(pinned=pinned, precision=resolve_precision(cfg.train.precision, cuda=True), fp8=cfg.train.fp8)
    found = search(cfg.model, cfg.train.global_batch_size, cluster, space=space)
    if json_path:
        write_json(json_path, found, step_error(cluster.gpu.name)[0])
    if not found:
        return _one_line(
            "config error: "
            + why_none(cfg.model, cfg.train.global_batch_size, cluster.world_size, cluster.gpus_per_node, space),
            2,
        )
    print(plan_table(found, 10, cluster))
    return 0 if any(p.fits for p in found) else 2


def _one_line(message: str, code: int) -> int:
    """Print an error once (on rank 0) and return the exit code: 2 configuration, 3 a run that cannot go on."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr)
    tell_torchrun(message)
    return code


def tell_torchrun(message: str, callstack: str | None = None) -> None:
    """Under torchrun, leave `message` in this rank's error file (TORCHELASTIC_ERROR_FILE) in the form its
    ErrorHandler writes: the failure summary torchrun prints after every failed run then shows `callstack` (by
    default the message) as each rank's `traceback`, where it said "error_file: <N/A>" and pointed to its docs,
    40 lines below our one line. Best effort: a file that cannot be written changes nothing else."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": callstack or message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
    except OSError:
        pass


MODES = ("--cfg", "--check", "--plan")


def _json_option(args: list[str]) -> tuple[list[str], str | None]:
    """(the overrides, the path after --json or None)."""
    if "--json" not in args:
        return args, None
    i = args.index("--json")
    if i + 1 >= len(args) or "=" in args[i + 1]:
        raise ConfigError("--json needs a file path, e.g. --json plan.json")
    return args[:i] + args[i + 2 :], args[i + 1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "usage: train.py [key=value ...]   e.g. model=gpt2-124m zero.stage=2 train.steps=100\n"
            "       train.py --cfg [key=value ...]   print the composed config and exit\n"
            "       train.py --check [key=value ...] [--json PATH]   validate it for WORLD_SIZE ranks, predict its\n"
            "                memory, step time and MFU on the cluster (cluster.*), exit 0, or 2 if it does not fit\n"
            "       train.py --plan [key=value ...] [--json PATH]   rank every layout of the model and batch on\n"
            "                cluster.nodes x cluster.gpus_per_node GPUs (a parallel.*, zero.* or micro-batch key\n"
            "                given pins that setting)"
        )
        return 0
    mode = argv[0] if argv[:1] and argv[0] in MODES else None
    try:
        overrides, json_path = _json_option(argv[1:] if mode else argv)
        if json_path is not None and mode not in ("--check", "--plan"):
            raise ConfigError("--json goes with --check or --plan")
        if mode == "--plan":
            return _plan(overrides, json_path)
        cfg, layout = resolved(overrides)
        if mode == "--cfg":
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        if mode == "--check":
            return _check(cfg, json_path)
    except ConfigError as err:
        return _one_line(f"config error: {err}", 2)
    import torch.distributed as dist

    from megatron_lite.faults.stalls import collective_timed_out, name_stalled
    from megatron_lite.faults.stragglers import STRAGGLER_EXIT
    from megatron_lite.training import run

    try:
        summary = run(cfg, layout)
    except RunError as err:
        return _one_line(f"error: {err}", 3)
    except RuntimeError as err:  # a collective's timeout: name the rank that stalled, then end like a crash
        if not (dist.is_initialized() and collective_timed_out(err)):
            raise
        reporter, message = name_stalled(grace_s=min(2 * cfg.dist.step_timeout_s, 120))
        if dist.get_rank() == reporter:
            print(f"error: {message}", file=sys.stderr, flush=True)
        tell_torchrun(f"error: {message}")  # every live rank: torchrun's root cause is whichever it saw end first
        return 4
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return STRAGGLER_EXIT if summary.get("straggler") is not None else 0


def exit_process(main_function: Callable[[], int | None]) -> NoReturn:
    """Run `main_function` and end the process with its code (None is 0; an uncaught error prints its traceback
    and gives 1, as with sys.exit), skipping the interpreter's teardown. gloo's worker threads let go of a
    collective's work only after its caller has returned; when the caller's tensor is gone by then, letting go
    takes the GIL, and during the interpreter's teardown taking the GIL ends the thread (pthread_exit), which
    C++ turns into std::terminate: a rank that had finished cleanly aborted with "terminate called without an
    active exception", exit -6 (5 of 35 stops during start-up, whose last collective is the stop flag's
    all-reduce; backtrace AsyncAllreduceWork::~AsyncWork, TensorImpl::decref_pyobject, take_gil,
    PyThread_exit_thread). Stop signals are ignored from here (during the teardown Python would put their
    default action back and a late SIGTERM would turn 0 into 143) and the atexit functions (wandb's, logging's)
    run before the exit, as they would."""
    try:
        code = main_function()
    except Exception as err:
        traceback.print_exc()
        tell_torchrun(f"{type(err).__name__}: {err}", traceback.format_exc())
        code = 1
    from megatron_lite.faults import stop

    stop.ignore()
    atexit._run_exitfuncs()  # the part of the teardown that must happen; the rest is what races
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
