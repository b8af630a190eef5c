"""Weights-only checkpoints (`meta["kind"] == "weights"`, one model.pt), written by tools/convert_hf.py, and
the full fp32 weights of any checkpoint: a ZeRO one through DeepSpeed's conversion, a tensor- or
pipeline-parallel one merged by the universal format. A run that resumes from weights only starts at their
step with a fresh optimizer."""

from __future__ import annotations

import glob
import os
import tempfile

import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.store import LATEST, META, atomic_write, read_meta, step_name
from megatron_lite.checkpoint.universal import convert_to_universal, universal_dir
from megatron_lite.config import ModelConfig
from megatron_lite.engine import ds_checkpoint
from megatron_lite.engine.repairs import nvme_checkpoint


def save_model_state(
    ckpt_root: str, model_cfg: ModelConfig, state_dict: dict, step: int = 0, extra_meta: dict | None = None
) -> str:
    """Write a committed weights-only checkpoint (one process, no DeepSpeed); returns its directory."""
    from dataclasses import asdict

    tag = step_name(step)
    path = os.path.join(ckpt_root, tag)
    os.makedirs(path, exist_ok=True)
    torch.save(
        {k: v.detach().cpu().float().contiguous() for k, v in state_dict.items()}, os.path.join(path, "model.pt")
    )
    store.fsync_tree(path)
    meta = {
        "kind": "weights",
        "step": step,
        "consumed_samples": 0,
        "model": asdict(model_cfg),
        "manifest": store.manifest_share(path, 0, 1),
        **(extra_meta or {}),
    }
    atomic_write(os.path.join(path, META), store.meta_text(meta))
    atomic_write(os.path.join(ckpt_root, LATEST), tag)
    return path


def _model_cfg_from_meta(meta: dict) -> ModelConfig:
    fields = meta["model"] if meta["kind"] == "weights" else meta["config"]["model"]
    return ModelConfig(**fields)


def _merged_weights(path: str, meta: dict, model_cfg: ModelConfig) -> dict:
    """Full fp32 weights of a tensor- or pipeline-parallel checkpoint, any ZeRO stage, or of one whose optimizer
    was swapped to NVMe (its optimizer files lack the swapped masters): the universal conversion
    (checkpoint/universal.py) merges the TP shards with the split patterns saved beside them and unions the
    pipeline stages (parameter names are global; the tied embedding's two copies are equal); vocabulary rows
    come back unpadded."""
    from megatron_lite.model.gpt import padded_vocab_size

    zero_dir = os.path.join(convert_to_universal(path, universal_dir(path, tempfile.gettempdir())), "zero")
    rows, widths = padded_vocab_size(model_cfg), _widths(path) if meta["layout"].get("tp", 1) == 1 else {}
    return {
        name: ds_checkpoint.universal_tensor(zero_dir, name, "fp32", rows, widths.get(name))
        for name in sorted(os.listdir(zero_dir))
        if os.path.isdir(os.path.join(zero_dir, name))
    }


def _widths(path: str) -> dict[str, int]:
    """name -> last dim of each matrix, from the shapes a tp=1 ZeRO checkpoint's model-states files record
    (DeepSpeed's merge leaves a tp=1 ZeRO-3 checkpoint's tensors flat)."""
    widths = {}
    for file in glob.glob(os.path.join(path, "*model_states.pt")):
        for group in torch.load(file, map_location="cpu", weights_only=False).get("param_shapes") or ():
            widths.update({name: shape[-1] for name, shape in group.items() if len(shape) == 2})
    return widths


def step_dir(path: str) -> str:
    """A checkpoint path as given: a root with `latest` resolves to the step directory it names."""
    if os.path.isfile(os.path.join(path, LATEST)):
        resolved = store.latest_checkpoint(path)
        if resolved is None:
            raise FileNotFoundError(f"{path}/latest names no complete checkpoint")
        return resolved
    return path


def load_model_state(path: str, verify: bool = True) -> tuple[ModelConfig, dict]:
    """Full fp32 weights of any checkpoint (a root with `latest`, or a step dir), keyed like our GPT. verify: check
    every file against the commit's manifest first, checksums included (a run's resume has checked them already):
    a damaged file was exported without a word (one changed value in a swap file's copy: 10000 in a row of wte)."""
    path = step_dir(path)
    problem = store.verify(path, checksums=True) if verify else None
    if problem is not None:
        raise ValueError(f"{path} cannot be read: {problem}")
    meta = read_meta(path)
    model_cfg = _model_cfg_from_meta(meta)
    if meta["kind"] == "weights":
        # Memory-mapped: a rank that builds only its share (model/build.py) reads only the tensors it takes.
        return model_cfg, torch.load(os.path.join(path, "model.pt"), weights_only=True, mmap=True)
    if nvme_checkpoint.unrecorded(path, meta):
        raise ValueError(
            f"{path} was written with zero.offload_optimizer=nvme by a version that did not record where "
            "its swapped weights are (before 2026-11-29); export an earlier checkpoint of another offload"
        )
    if meta["layout"].get("tp", 1) > 1 or meta["layout"].get("pp", 1) > 1 or nvme_checkpoint.recorded(path):
        return model_cfg, _merged_weights(path, meta, model_cfg)
    if meta["layout"]["zero_stage"] == 0:
        files = sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")))
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    else:
        state = ds_checkpoint.zero_fp32_weights(path)
    return model_cfg, {k: v.float() for k, v in state.items()}
