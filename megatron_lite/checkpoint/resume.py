"""Which checkpoint a job resumes, and whether it can: resume=auto's choice among the committed checkpoints
(checkpoint/store.py checks them), the config-time check of a resume before any process group, and what a
checkpoint's layout means for this job (the same layout continues every rank's RNG streams; another number of
ZeRO partitions, TP size, stage, pipeline layout or state format goes through the universal format; a changed data stream is
said by key)."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.store import META, read_meta
from megatron_lite.config import override_value
from megatron_lite.errors import ConfigError, RunError


def warn(text: str) -> None:
    print(f"warning: {text}", flush=True)


def _agreed_problem(path: str, ctx) -> str | None:
    """Collective: every rank checksums its share of path's manifest (and meta.json its own); the first problem
    any rank found."""
    mine = store.meta_problem(path) if store.is_complete(path) else f"{os.path.join(path, META)} is missing"
    manifest = read_meta(path).get("manifest") if mine is None else None
    if manifest is not None:
        mine = store.verify_share(path, manifest, ctx.rank, ctx.world_size)
    found = [None] * ctx.world_size
    dist.all_gather_object(found, mine)
    return next((p for p in found if p is not None), None)


def _pick_auto(root: str, problem_of) -> tuple[str | None, list[str]]:
    """resume=auto: the first candidate (checkpoint_store.resume_candidates) for which problem_of(path) is None,
    and notes on every one passed over; (None, notes) when none is sound."""
    candidates, notes = store.resume_candidates(root)
    for path in candidates:
        problem = problem_of(path)
        if problem is None:
            return path, notes
        notes.append(f"{os.path.basename(path)}: {problem}")
    return None, notes


def _none_sound(root: str, notes: list[str]) -> str | None:
    """The one-line message when resume=auto found committed checkpoints but none sound; None when none was
    ever committed there. Step directories without meta.json alone (a first save that was interrupted) are not
    checkpoints: the run starts fresh and its own saves replace or prune them (store.clear_for_write, prune)."""
    if not notes:
        return None
    return (
        f"checkpoint.resume=auto found no sound checkpoint in checkpoint.dir={root}: {'; '.join(notes)}. "
        "Nothing was deleted; to start fresh there use checkpoint.resume=never, or another checkpoint.dir"
    )


def choose_resume(resume: str, root: str, ctx) -> str | None:
    """Collective: the checkpoint to resume (None: start fresh), every file checked against its manifest.
    resume=auto falls back past unsound checkpoints with a warning (checkpoint/store.py); an explicit path
    does not fall back. Raises RunError (one line) when checkpoints exist and none is sound."""
    if resume == "never":
        # A fresh run's saves and pruning would otherwise delete the committed checkpoints of the run before it
        # (prune keeps the newest `keep` of every step_* up to the one just committed), and a restart with
        # resume=auto could pick one of those. Set them aside (renamed, never deleted) before the first save.
        if ctx.is_rank0:
            old = store.complete_steps(root)
            moved = [store.set_aside(p, "before_resume_never") for p in old]
            if os.path.isfile(os.path.join(root, store.LATEST)):
                os.remove(os.path.join(root, store.LATEST))
            if moved:
                warn(
                    f"checkpoint.resume=never: the {len(moved)} committed checkpoint(s) already in checkpoint.dir="
                    f"{root} are kept, renamed: {', '.join(map(os.path.basename, moved))}"
                )
        dist.barrier()
        return None
    if resume != "auto":
        problem = _agreed_problem(resume, ctx)
        if problem is not None:
            raise RunError(
                f"checkpoint.resume={resume} cannot be loaded: {problem}; resume another checkpoint "
                "or use checkpoint.resume=auto"
            )
        return resume
    path, notes = _pick_auto(root, lambda p: _agreed_problem(p, ctx))
    if path is not None:
        if notes and ctx.is_rank0:
            warn(f"resuming from {path}: " + "; ".join(notes))
        return path
    message = _none_sound(root, notes)
    if message is not None:
        raise RunError(message)
    leftovers = store.uncommitted_leftovers(root)
    if leftovers and ctx.is_rank0:
        names = ", ".join(map(os.path.basename, leftovers))
        warn(
            f"checkpoint.dir={root} holds only step directories that never committed ({names}: an interrupted "
            "first save); starting from step 0"
        )
    return None


def first_sound(root: str) -> str | None:
    """One process, before any process group: what choose_resume(auto) will most likely pick (sizes only)."""
    return _pick_auto(root, store.verify)[0]


# --- layouts -------------------------------------------------------------------------------------------

# The settings that decide which samples each step sees (data/sampler.py); model.seq_len may change only with
# RoPE (check_resume).
DATA_STREAM_KEYS = (
    ("seed",),
    ("data", "path"),
    ("data", "weights"),
    ("data", "document_mask"),
    ("model", "seq_len"),
    ("train", "global_batch_size"),
)


def data_stream_changes(saved_config: dict, cfg) -> list[str]:
    """`key: saved -> now` for every data-stream setting a resume changes (the steps after it see other
    samples than the uninterrupted run would have)."""
    from dataclasses import asdict

    now, out = asdict(cfg), []
    for key in DATA_STREAM_KEYS:
        old, new = saved_config, now
        for part in key:
            old, new = (old or {}).get(part), new.get(part)
        if old is not None and old != new:
            out.append(f"{'.'.join(key)}: {old} -> {new}")
    return out


def check_resume(cfg) -> None:
    """Before any process group: refuse a resume that cannot work, in one line (raises ConfigError). Any other
    layout, ZeRO stage or precision loads (through the universal form and our loaders, engine/repairs/universal_load.py,
    which cut its full fp32 tensors as this run's model builds), NVMe optimizer offload included; a model of
    another shape does not, nor an NVMe checkpoint of a version that did not record its swapped states."""
    from dataclasses import asdict

    resume, root = cfg.checkpoint.resume, cfg.checkpoint.dir
    if resume == "never":
        return
    if resume == "auto":
        path, notes = _pick_auto(root, store.verify)  # sizes only: the ranks checksum at load (choose_resume)
        if path is None:
            message = _none_sound(root, notes)
            if message is not None:
                raise ConfigError(message)
            return
    else:
        path = resume
        newer = store.newer_checkpoints(root, read_meta(path).get("step", 0))
        if newer:
            raise ConfigError(
                f"checkpoint.resume={resume} would train over newer checkpoints in checkpoint.dir={root} "
                f"({', '.join(os.path.basename(p) for p in newer)}); resume the newest "
                "(checkpoint.resume=auto), or write to another checkpoint.dir"
            )
    meta = read_meta(path)
    saved = meta["model"] if meta["kind"] == "weights" else meta["config"]["model"]
    differ = {
        key: (value, saved.get(key))
        for key, value in asdict(cfg.model).items()
        if key not in ("name", "dropout") and saved.get(key) != value
    }
    if cfg.model.position == "rope" == saved.get("position"):  # RoPE's tables are computed for any length
        differ.pop("seq_len", None)
    if differ:  # every differing key at once: an imported model's shape is typed in one go
        ours = ", ".join(f"model.{key}={value}" for key, (value, _) in differ.items())
        theirs = " ".join(f"model.{key}={override_value(old)}" for key, (_, old) in differ.items())
        raise ConfigError(
            f"{ours} {'differs' if len(differ) == 1 else 'differ'} from the checkpoint {path} ({theirs}); "
            f"use {theirs}, or checkpoint.resume=never / another checkpoint.dir"
        )
    from megatron_lite.engine.repairs import nvme_checkpoint

    if nvme_checkpoint.unrecorded(path, meta):
        raise ConfigError(
            f"checkpoint.resume: {path} was written with zero.offload_optimizer=nvme by an older "
            "version, which did not record where its swapped optimizer states are; resume an "
            "earlier checkpoint of another offload, or start afresh (checkpoint.resume=never)"
        )
