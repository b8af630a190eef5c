"""Checkpoint contents with a DeepSpeed engine: save and load (the on-disk commit protocol, manifests,
fallback and pruning are checkpoint_store.py), RNG streams, the universal conversion for layout changes,
weights-only checkpoints for HF import/export, and the config-time check of a resume.

Elastic resume: when the checkpoint's DP or TP size or ZeRO stage differs from the current job's, rank 0
converts it once into DeepSpeed's universal (layout-free) format beside the shards (path/universal), and every
rank loads that. TP shards merge and re-split by the split patterns the engine saved with the checkpoint
(model/layout.universal_split_patterns). The same conversion gives tools/convert_hf.py the full weights of a TP run.

Weights-only checkpoints (`meta["kind"] == "weights"`, a single model.pt) come from tools/convert_hf.py;
a run that resumes from one starts at its step with a fresh optimizer.
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import pickle
import random
import shutil
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_lite import checkpoint_store as store
from megatron_lite.checkpoint_store import LATEST, META, UNIVERSAL, atomic_write, read_meta, step_name
from megatron_lite.config import ModelConfig, RunError


def _warn(text: str) -> None:
    print(f"warning: {text}", flush=True)


def _agreed_problem(path: str, ctx) -> str | None:
    """Collective: every rank checksums its share of path's manifest; the first problem any rank found."""
    try:
        manifest = read_meta(path).get("manifest")
    except (OSError, ValueError) as err:
        return f"{os.path.join(path, META)} cannot be read ({err})"
    mine = None if manifest is None else store.verify_share(path, manifest, ctx.rank, ctx.world_size)
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
    """The one-line message when resume=auto found checkpoints but none sound; None when there were none."""
    leftovers = store.uncommitted_leftovers(root)
    if not notes and not leftovers:
        return None
    found = "; ".join(notes) or f"only uncommitted step directories ({', '.join(leftovers)})"
    return (f"checkpoint.resume=auto found no sound checkpoint in checkpoint.dir={root}: {found}. Nothing was "
            "deleted; to start fresh there use checkpoint.resume=never, or another checkpoint.dir")


def choose_resume(resume: str, root: str, ctx) -> str | None:
    """Collective: the checkpoint to resume (None: start fresh), every file checked against its manifest.
    resume=auto falls back past unsound checkpoints with a warning (checkpoint_store.py); an explicit path
    does not fall back. Raises RunError (one line) when checkpoints exist and none is sound."""
    if resume == "never":
        return None
    if resume != "auto":
        problem = _agreed_problem(resume, ctx)
        if problem is not None:
            raise RunError(f"checkpoint.resume={resume} cannot be loaded: {problem}; resume another checkpoint "
                           "or use checkpoint.resume=auto")
        return resume
    path, notes = _pick_auto(root, lambda p: _agreed_problem(p, ctx))
    if path is not None:
        if notes and ctx.is_first:
            _warn(f"resuming from {path}, an older checkpoint: " + "; ".join(notes))
        return path
    message = _none_sound(root, notes)
    if message is not None:
        raise RunError(message)
    return None


def first_sound(root: str) -> str | None:
    """One process, before any process group: what choose_resume(auto) will most likely pick (sizes only)."""
    return _pick_auto(root, store.verify)[0]


# --- RNG streams ------------------------------------------------------------------------------------------

def rng_state() -> dict:
    """The default streams of this rank: python, numpy, torch (CPU, CUDA). Dropout masks are not among them:
    they are keyed by (seed, step, micro-batch, layer, site, tp rank) (parallel/random.py), so the step in
    meta.json is all an exact resume needs for them."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state(); the "tp" entry of older checkpoints (a per-TP-rank dropout stream) is ignored."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _encode(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


# --- save / load with a DeepSpeed engine ------------------------------------------------------------------

def save(engine, ctx, root: str, step: int, meta: dict, keep: int) -> str:
    """Collective: every rank writes and fsyncs its shards, the ranks checksum them, rank 0 commits
    (checkpoint_store.py). Returns the step directory."""
    tag = step_name(step)
    path = os.path.join(root, tag)
    if ctx.is_first:
        os.makedirs(root, exist_ok=True)
        aside = store.clear_for_write(path)
        if aside is not None:
            _warn(f"{path} held a committed checkpoint this run replaces (passed over at resume as unsound, or "
                  f"left by a run before checkpoint.resume=never); kept as {aside}")
    dist.barrier()
    engine.save(root, tag)
    torch.save(rng_state(), os.path.join(path, f"rng_rank{ctx.rank:05d}.pt"))
    dist.barrier()  # every rank's files exist
    store.fsync_tree(path)  # this rank's writes (and everyone's, harmlessly) reach the disk
    shares = [None] * ctx.world_size
    dist.all_gather_object(shares, store.manifest_share(path, ctx.rank, ctx.world_size))
    if ctx.is_first:
        manifest = {rel: entry for share in shares for rel, entry in share.items()}
        meta = dict(meta, step=step, kind="deepspeed", rng_rank0=_encode(rng_state()), manifest=manifest)
        atomic_write(os.path.join(path, META), json.dumps(meta, indent=1, default=str))
        atomic_write(os.path.join(root, LATEST), tag)
        store.prune(root, keep, step)
    dist.barrier()
    return path


def same_layout(layout: dict, ctx, zero_stage: int, pipe: tuple | None) -> bool:
    """Whether a checkpoint was written with this job's whole layout: dp, tp, cp, pipeline and ZeRO stage."""
    saved = (layout["world_size"], layout["dp"], layout.get("tp", 1), layout.get("cp", 1), layout["zero_stage"])
    return saved == (ctx.world_size, ctx.dp_size, ctx.tp_size, ctx.cp_size, zero_stage) and \
        (pipe is None or saved_pipeline(layout) == pipe)


# The settings that decide which samples each step sees (data/sampler.py); model.seq_len is checked with the
# model (check_resume).
DATA_STREAM_KEYS = (("seed",), ("data", "path"), ("train", "global_batch_size"))


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


def needs_universal(meta: dict, dp_size: int, tp_size: int, zero_stage: int, pipe: tuple | None = None,
                    cp_size: int = 1) -> bool:
    """A ZeRO checkpoint goes through the universal format when the number of ZeRO partitions (dp x cp: the
    parameters are replicated over cp), the TP size, the stage or the pipeline layout (pp, vpp, layers per
    virtual stage) changes. pipe: the current (pp, vpp, layers_per_stage)."""
    layout = meta.get("layout")
    if meta.get("kind") != "deepspeed" or layout["zero_stage"] == 0:
        return False
    if pipe is not None and pipe != saved_pipeline(layout):
        return True
    saved = (layout["dp"] * layout.get("cp", 1), layout.get("tp", 1), layout["zero_stage"])
    return saved != (dp_size * cp_size, tp_size, zero_stage)


def saved_pipeline(layout: dict) -> tuple:
    """(pp, vpp, layers per virtual stage) a checkpoint was written with (older ones: no pipeline)."""
    pp, vpp = layout.get("pp", 1), layout.get("vpp", 1)
    return pp, vpp, tuple(layout.get("layers_per_stage") or ()) if pp * vpp > 1 else ()  # as current_pipeline


def current_pipeline(cfg) -> tuple:
    from megatron_lite.pipeline.partition import layers_per_stage

    p = cfg.parallel
    layers = layers_per_stage(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers)
    return p.pp, p.vpp, tuple(layers) if p.pp * p.vpp > 1 else ()


def convert_to_universal(path: str) -> str:
    """Convert the ZeRO checkpoint `path` into path/universal once (atomically); one process, no groups."""
    target = os.path.join(path, UNIVERSAL)
    if not os.path.isfile(os.path.join(target, "done")):
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        ds_to_universal(argparse.Namespace(
            input_folder=path, output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=False,
        ))
        open(os.path.join(tmp, "done"), "w").close()
        os.replace(tmp, target)
    return target


def prepare_universal(path: str, ctx) -> None:
    """Rank 0 converts `path` to the universal format; the others wait for its `done` file on disk, not in a
    collective: converting a large checkpoint can outlast any collective timeout (dist.timeout_s). Should
    rank 0 die meanwhile, torchrun (or srun) ends the others."""
    if ctx.is_first:
        convert_to_universal(path)
    else:
        while not os.path.isfile(os.path.join(path, UNIVERSAL, "done")):
            time.sleep(0.5)
    dist.barrier()


def load(engine, ctx, path: str, zero_stage: int, pipe: tuple | None = None) -> dict:
    """Collective: load `path` into the engine, restore this rank's RNG streams; return meta. pipe: the
    current (pp, vpp, layers per virtual stage), see current_pipeline."""
    meta = read_meta(path)
    if needs_universal(meta, ctx.dp_size, ctx.tp_size, zero_stage, pipe, ctx.cp_size):
        prepare_universal(path, ctx)
        engine.load(path, UNIVERSAL)
    else:
        engine.load(os.path.dirname(path), os.path.basename(path))
    # Same layout: each rank continues its own streams. Any other layout (even at the same world size, where
    # rank r would now play another role): every rank takes rank 0's streams, the same on every rank whatever
    # the layout. Dropout masks follow either way: they are keyed by the step, not drawn from these streams.
    own = os.path.join(path, f"rng_rank{ctx.rank:05d}.pt")
    if same_layout(meta["layout"], ctx, zero_stage, pipe) and os.path.isfile(own):
        set_rng_state(torch.load(own, weights_only=False))
    else:
        set_rng_state(_decode(meta["rng_rank0"]))
    return meta


# --- weights only (HF import/export, evaluation) ----------------------------------------------------------

def save_model_state(ckpt_root: str, model_cfg: ModelConfig, state_dict: dict, step: int = 0) -> str:
    """Write a committed weights-only checkpoint (one process, no DeepSpeed); returns its directory."""
    from dataclasses import asdict

    tag = step_name(step)
    path = os.path.join(ckpt_root, tag)
    os.makedirs(path, exist_ok=True)
    torch.save({k: v.detach().cpu().float().contiguous() for k, v in state_dict.items()},
               os.path.join(path, "model.pt"))
    store.fsync_tree(path)
    meta = {"kind": "weights", "step": step, "consumed_samples": 0, "model": asdict(model_cfg),
            "manifest": store.manifest_share(path, 0, 1)}
    atomic_write(os.path.join(path, META), json.dumps(meta, indent=1))
    atomic_write(os.path.join(ckpt_root, LATEST), tag)
    return path


def _model_cfg_from_meta(meta: dict) -> ModelConfig:
    fields = meta["model"] if meta["kind"] == "weights" else meta["config"]["model"]
    return ModelConfig(**fields)


def _merged_weights(path: str, meta: dict, model_cfg: ModelConfig) -> dict:
    """Full fp32 weights of a tensor- or pipeline-parallel checkpoint: DeepSpeed's universal conversion merges
    the TP shards with the split patterns saved beside them and unions the pipeline stages (parameter names
    are global; the tied embedding's two copies are equal); vocabulary rows come back unpadded."""
    layout = meta["layout"]
    if layout["zero_stage"] == 0:
        split = " x ".join(f"parallel.{k}={layout.get(k, 1)}" for k in ("tp", "pp") if layout.get(k, 1) > 1)
        raise ValueError(f"{path} was written at {split} with zero.stage=0; merging its shards needs a ZeRO 1-3 "
                         "checkpoint (resume it with zero.stage=1 and save again)")
    from megatron_lite.model.gpt import padded_vocab_size

    zero_dir = os.path.join(convert_to_universal(path), "zero")
    rows = padded_vocab_size(model_cfg)
    state = {}
    for name in sorted(os.listdir(zero_dir)):
        if not os.path.isdir(os.path.join(zero_dir, name)):
            continue
        full = torch.load(os.path.join(zero_dir, name, "fp32.pt"), weights_only=False)["param"].float()
        if name in ("wte.weight", "lm_head.weight") and full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], full.shape[1])])
        state[name] = full
    return state


def load_model_state(path: str) -> tuple[ModelConfig, dict]:
    """Full fp32 weights of any checkpoint (a root with `latest`, or a step dir), keyed like our GPT."""
    if os.path.isfile(os.path.join(path, LATEST)):
        resolved = store.latest_checkpoint(path)
        if resolved is None:
            raise FileNotFoundError(f"{path}/latest names no complete checkpoint")
        path = resolved
    meta = read_meta(path)
    model_cfg = _model_cfg_from_meta(meta)
    if meta["kind"] == "weights":
        # Memory-mapped: a rank that builds only its share (model/build.py) reads only the tensors it takes.
        return model_cfg, torch.load(os.path.join(path, "model.pt"), weights_only=True, mmap=True)
    if meta["layout"].get("tp", 1) > 1 or meta["layout"].get("pp", 1) > 1:
        return model_cfg, _merged_weights(path, meta, model_cfg)
    if meta["layout"]["zero_stage"] == 0:
        files = sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")))
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(path), tag=os.path.basename(path))
    return model_cfg, {k: v.float() for k, v in state.items()}


def check_resume(cfg, world_size: int) -> None:
    """Before any process group: refuse a resume that cannot work, in one line (raises ConfigError)."""
    from dataclasses import asdict

    from megatron_lite.config import ConfigError
    from megatron_lite.deepspeed_config import holds_bf16, resolve_precision

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
            raise ConfigError(f"checkpoint.resume={resume} would train over newer checkpoints in checkpoint.dir={root} "
                              f"({', '.join(os.path.basename(p) for p in newer)}); resume the newest "
                              "(checkpoint.resume=auto), or write to another checkpoint.dir")
    meta = read_meta(path)
    saved = meta["model"] if meta["kind"] == "weights" else meta["config"]["model"]
    for key, value in asdict(cfg.model).items():
        if key not in ("name", "dropout") and saved.get(key) != value:
            raise ConfigError(f"model.{key}={value} differs from the checkpoint {path} (model.{key}={saved.get(key)}); "
                              f"use model.{key}={saved.get(key)}, or checkpoint.resume=never / another checkpoint.dir")
    if meta["kind"] == "deepspeed":
        saved_pipe, pipe = saved_pipeline(meta["layout"]), current_pipeline(cfg)
        saved_stage = meta["layout"]["zero_stage"]
        if saved_pipe != pipe and not (saved_stage in (1, 2) and cfg.zero.stage in (1, 2)):
            raise ConfigError(f"parallel.pp={cfg.parallel.pp} (vpp {pipe[1]}) cannot resume {path}, written at "
                              f"parallel.pp={saved_pipe[0]} (vpp {saved_pipe[1]}, layers {list(saved_pipe[2])}) with "
                              f"zero.stage={saved_stage}; pipeline resharding works between ZeRO stages 1 and 2: use "
                              f"the saved layout, or save and resume with zero.stage=1 or 2")
        saved_tp, saved_stage = meta["layout"].get("tp", 1), meta["layout"]["zero_stage"]
        if saved_tp != cfg.parallel.tp and not (saved_stage in (1, 2) and cfg.zero.stage in (1, 2)):
            raise ConfigError(f"parallel.tp={cfg.parallel.tp} cannot resume {path}, written at parallel.tp={saved_tp} "
                              f"with zero.stage={saved_stage}; TP resharding works between ZeRO stages 1 and 2: "
                              f"use parallel.tp={saved_tp}, or save and resume with zero.stage=1 or 2")
        saved_precision = meta["layout"].get("precision")  # resolved (auto -> bf16/fp32); absent before bf16 fixes
        precision = resolve_precision(cfg)
        if saved_precision is not None and holds_bf16(saved_precision, saved_stage) != holds_bf16(precision, cfg.zero.stage):
            raise ConfigError(f"train.precision={cfg.train.precision} ({precision} at zero.stage={cfg.zero.stage}) cannot "
                              f"resume {path}, written in {saved_precision} at zero.stage={saved_stage}: DeepSpeed keeps "
                              f"bf16 and fp32 ZeRO states in different formats; use train.precision={saved_precision}")
        if saved_stage != cfg.zero.stage and 0 in (saved_stage, cfg.zero.stage):
            raise ConfigError(f"zero.stage={cfg.zero.stage} cannot resume {path}, written with zero.stage={saved_stage}; "
                              f"use zero.stage={saved_stage} (ZeRO 1, 2 and 3 convert into each other, 0 does not)")
