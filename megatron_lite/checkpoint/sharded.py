"""Checkpoint contents with a DeepSpeed engine: save (every rank's shards and RNG streams, then rank 0 commits
through checkpoint/store.py: fsync, manifest, `latest`, pruning) and load. A checkpoint of the job's own layout
loads through DeepSpeed; any other layout, ZeRO stage or precision through its universal form and our loaders
(checkpoint/universal.py, engine/repairs/universal_load.py); an optimizer swapped to NVMe also through its swap
files' copies (engine/repairs/nvme_checkpoint.py). Everything DeepSpeed-specific is the Engine's.

Which checkpoint to resume and whether it can be resumed: checkpoint/resume.py. Weights-only checkpoints
(HF import/export): checkpoint/weights.py.
"""

from __future__ import annotations

import base64
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_lite.checkpoint import store, universal
from megatron_lite.checkpoint.resume import warn
from megatron_lite.checkpoint.store import LATEST, META, atomic_write, step_name
from megatron_lite.engine.repairs import nvme_checkpoint
from megatron_lite.layout import Layout

# --- RNG streams ------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """The default streams of this rank: python, numpy, torch (CPU, CUDA), as tensors and plain numbers, so that
    reading them back needs no pickle (torch.load(weights_only=True); meta.json keeps rank 0's as JSON). Dropout
    masks are not among them: they are keyed by (seed, step, micro-batch, layer, site, tp rank)
    (parallel/random.py), so the step in meta.json is all an exact resume needs for them."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s streams."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_to_json(state: dict) -> dict:
    """rng_state() as JSON values: generator states as base64 of their bytes, numpy's key as a list."""
    out = {"python": state["python"], "numpy": [*state["numpy"][:1], state["numpy"][1].tolist(), *state["numpy"][2:]]}
    for key in ("torch", "cuda"):
        if key in state:
            out[key] = base64.b64encode(state[key].numpy().tobytes()).decode()
    return out


def rng_from_json(obj: dict) -> dict:
    state = {"python": obj["python"], "numpy": obj["numpy"]}
    for key in ("torch", "cuda"):
        if key in obj:
            state[key] = torch.frombuffer(bytearray(base64.b64decode(obj[key])), dtype=torch.uint8)
    return state


def load_rng(path: str, meta: dict, own_streams: bool) -> None:
    """Restore this rank's streams (own_streams: its own file, else rank 0's from meta.json), never through
    pickle, which could run code from a checkpoint someone else made. Checkpoints written before the streams
    were stored this way keep them pickled: those are left unread, with a warning (the streams only seed
    what is not keyed; the dropout masks and the data order do not depend on them)."""
    if own_streams:
        try:
            set_rng_state(torch.load(path, weights_only=True))
            return
        except Exception:  # noqa: BLE001 - an older pickled file: fall through to meta.json's copy
            pass
    if isinstance(meta.get("rng_rank0"), dict):
        set_rng_state(rng_from_json(meta["rng_rank0"]))
    else:
        warn(
            f"{os.path.dirname(path)} keeps its RNG streams pickled (written by an older version), which loading "
            "could run code from; they are not restored (dropout masks and the data order do not use them)"
        )


# --- save / load with a DeepSpeed engine ------------------------------------------------------------------


def _prepare(ctx, root: str, step: int) -> tuple[str, str]:
    tag = step_name(step)
    path = os.path.join(root, tag)
    if ctx.is_rank0:
        os.makedirs(root, exist_ok=True)
        aside = store.clear_for_write(path)
        if aside is not None:
            warn(
                f"{path} held a committed checkpoint this run replaces (passed over at resume as unsound, or "
                f"left by a run before checkpoint.resume=never); kept as {aside}"
            )
    dist.barrier()
    return tag, path


def _commit(root: str, path: str, step: int, meta: dict, manifest: dict, rng0: dict, keep: int) -> None:
    """Rank 0, once every rank's files are durable: meta.json with the manifest, then `latest`, then pruning."""
    meta = dict(meta, step=step, kind="deepspeed", rng_rank0=rng_to_json(rng0), manifest=manifest)
    atomic_write(os.path.join(path, META), store.meta_text(meta))
    atomic_write(os.path.join(root, LATEST), os.path.basename(path))
    store.prune(root, keep, step)


def save_async(engine, ctx, root: str, step: int, meta: dict, keep: int, writer) -> str:
    """checkpoint.async_save (checkpoint/writer.py): collective staging to host memory, then this rank's background
    write; rank 0's background thread commits. Returns the step directory (not yet committed)."""
    from megatron_lite.checkpoint.writer import remove_shares, to_host

    writer.wait(reason=f"checkpoint of step {step}")
    tag, path = _prepare(ctx, root, step)
    staged = engine.save_staged(root, tag, lambda state: to_host(state, torch.cuda.is_available(), writer.pool))
    rng = rng_state()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the pinned copies have landed before the writer reads them
    files = staged + [(os.path.join(path, f"rng_rank{ctx.rank:05d}.pt"), rng)]
    offloaded = engine.swap_record(path, ctx.rank)
    if offloaded is not None:
        files.append(offloaded)
        # DeepSpeed copied this rank's swap files in engine.save, in the foreground and unsynced: the writer fsyncs
        # only the files it writes, and the commit (meta.json) must not reach the disk before them (store.py)
        store.fsync_tree(os.path.join(path, offloaded[1]["folder"]))

    def commit(manifest: dict) -> None:
        _commit(root, path, step, meta, manifest, rng, keep)
        remove_shares(path)

    writer.submit(path, step, files, commit if ctx.is_rank0 else None)
    return path


def save(engine, ctx, root: str, step: int, meta: dict, keep: int) -> str:
    """Collective: every rank writes and fsyncs its shards, the ranks checksum them, rank 0 commits
    (checkpoint/store.py). Returns the step directory."""
    tag, path = _prepare(ctx, root, step)
    engine.save(root, tag)
    torch.save(rng_state(), os.path.join(path, f"rng_rank{ctx.rank:05d}.pt"))
    offloaded = engine.swap_record(path, ctx.rank)
    if offloaded is not None:
        torch.save(offloaded[1], offloaded[0])
    dist.barrier()  # every rank's files exist
    store.fsync_tree(path)  # this rank's writes (and everyone's, harmlessly) reach the disk
    shares = [None] * ctx.world_size
    dist.all_gather_object(shares, store.manifest_share(path, ctx.rank, ctx.world_size))
    if ctx.is_rank0:
        _commit(
            root, path, step, meta, {rel: entry for share in shares for rel, entry in share.items()}, rng_state(), keep
        )
    dist.barrier()
    return path


def load(engine, ctx, path: str, meta: dict, layout: Layout, scratch: str | None = None) -> None:
    """Collective: load `path` (whose meta.json the caller has read: `meta`) into the engine of this job's
    `layout`, and restore this rank's RNG streams. scratch: where a read-only checkpoint's universal form may go
    (the job's checkpoint.dir)."""
    saved = Layout.of_checkpoint(meta)
    # An optimizer swapped to NVMe on one side only loads through the universal form (DeepSpeed's load looks for
    # swap files the checkpoint lacks, or leaves its swapped states out); on both sides at the same layout, from
    # each rank's own files (DeepSpeed's load of that is not exact): engine/repairs/nvme_checkpoint.py
    swaps = engine.swaps_optimizer
    if layout.needs_conversion(saved) or swaps != nvme_checkpoint.recorded(path):
        target = universal.prepare_universal(path, ctx, scratch)
        engine.load_universal(os.path.join(target, "zero"))
    elif swaps:
        engine.load_swapped(path, ctx.rank)
    else:
        engine.load(os.path.dirname(path), os.path.basename(path))
    # Same layout: each rank continues its own streams. Any other layout (even at the same world size, where
    # rank r would now play another role): every rank takes rank 0's streams, the same on every rank whatever
    # the layout. Dropout masks follow either way: they are keyed by the step, not drawn from these streams.
    own = os.path.join(path, f"rng_rank{ctx.rank:05d}.pt")
    load_rng(own, meta, layout.same_as(saved) and os.path.isfile(own))
