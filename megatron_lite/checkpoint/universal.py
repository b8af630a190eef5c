"""The universal form of a checkpoint: one full fp32 tensor per parameter and per optimizer state, whatever the
layout, ZeRO stage or precision it was written with.

When a checkpoint's number of ZeRO partitions (dp x cp), TP size, ZeRO stage, pipeline layout or state format
(bf16 or fp32) differs from the current job's (layout.Layout.needs_conversion), or one of the two swaps its
optimizer to NVMe and the other does not, rank 0 converts it once into DeepSpeed's universal (layout-free) format
beside the shards (path/universal): DeepSpeed's converter merges the TP shards by the split patterns the engine
saved with the checkpoint (engine/ds_config.universal_split_patterns) into one full fp32 tensor per parameter and
state (a ZeRO-0 checkpoint, which has no ZeRO optimizer files, through its merge step alone: _zero0_to_universal;
an optimizer swapped to NVMe has its swapped states put back from the swap files first: engine/repairs/nvme_checkpoint.py).
Every rank then loads that with our loader for its ZeRO stage (engine/repairs/universal_load.py). The same conversion gives
checkpoint/weights.py the full weights of a TP or pipeline run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
import zlib

import torch.distributed as dist

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.resume import warn
from megatron_lite.checkpoint.store import UNIVERSAL, read_meta
from megatron_lite.engine import ds_checkpoint
from megatron_lite.engine.repairs import nvme_checkpoint


def universal_dir(path: str, scratch: str | None = None) -> str:
    """Where the universal form of checkpoint `path` goes: path/universal, or, when the step directory cannot be
    written (a read-only copy of a checkpoint), a directory of its own under `scratch` (the job's
    checkpoint.dir: a shared file system the job writes anyway)."""
    if scratch is None or os.access(path, os.W_OK):
        return os.path.join(path, UNIVERSAL)
    return os.path.join(
        scratch,
        f".{UNIVERSAL}_of_{os.path.basename(os.path.normpath(path))}_{zlib.crc32(os.path.realpath(path).encode()):08x}",
    )


def _universal_problem(target: str) -> str | None:
    """Why the universal form at `target` cannot be used as it is (None: every file matches the manifest its
    `done` file holds). A `done` without a manifest (written before 2026-11-28) cannot be checked."""
    try:
        with open(os.path.join(target, "done")) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return "not converted" if not os.path.exists(target) else "an unfinished conversion"
    except (OSError, ValueError):
        return "its conversion records no manifest to check it by"
    return store.verify_share(target, manifest, 0, 1)


def convert_to_universal(path: str, target: str | None = None) -> str:
    """Convert the checkpoint `path` into its universal form at `target` (default path/universal); one process,
    no groups. A finished conversion is used again once its files match its manifest (else it is made again,
    with a warning). Jobs converting the same checkpoint at once each write their own temporary directory and
    rename it into place; the first wins and the others use it. ZeRO 1-3 checkpoints go through DeepSpeed's
    converter whole (an NVMe-offloaded one's swapped states put back first: engine/repairs/nvme_checkpoint.with_states), a ZeRO-0 one
    through its merge step (_zero0_to_universal)."""
    target = target or os.path.join(path, UNIVERSAL)
    problem = _universal_problem(target)
    if problem is None:
        return target
    if os.path.exists(target):
        warn(f"{target}: {problem}; converting {path} again")
        shutil.rmtree(target, ignore_errors=True)
    # Outside the step directory, and reading it through a view of its own files: DeepSpeed's converter walks its
    # input directory, and would count the files of a conversion that another job finished meanwhile.
    parent = os.path.dirname(target)
    if os.path.realpath(parent) == os.path.realpath(path):
        parent = os.path.dirname(os.path.normpath(path))
    prefix = os.path.join(parent, f".{os.path.basename(os.path.normpath(path))}_{UNIVERSAL}.tmp.")
    _remove_killed_conversions(prefix)
    tmp = f"{prefix}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    view = tmp + ".input"
    os.makedirs(view)
    try:
        offloaded = nvme_checkpoint.by_file(path)
        for name in os.listdir(path):
            if name in offloaded:
                nvme_checkpoint.with_states(path, offloaded[name], os.path.join(view, name))
            elif os.path.isfile(os.path.join(path, name)):
                os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(view, name))
        meta = read_meta(path)
        if meta["layout"]["zero_stage"] == 0:
            ds_checkpoint.zero0_to_universal(path, meta, tmp)
        else:
            ds_checkpoint.zero_to_universal(view, tmp)
        manifest = store.manifest_share(tmp, 0, 1)  # before `done` exists: it is not among its own files
        with open(os.path.join(tmp, "done"), "w") as f:
            json.dump(manifest, f)
        store.fsync_tree(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another job's conversion got there first
            if _universal_problem(target) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(view, ignore_errors=True)
    return target


def _remove_killed_conversions(prefix: str) -> None:
    """Remove what conversions of this checkpoint killed part-way on this host left (<prefix><host>.<pid>.<hex>
    and its .input view: only the converting process's `finally` removes them), once their process is gone. An
    NVMe checkpoint's view holds real copies of its optimizer files (offload.with_states): a kill left all
    its optimizer states behind. Another host's are left alone: its pid means nothing here."""
    folder, start = os.path.split(prefix)
    host = socket.gethostname()
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        owner = name[len(start) :].split(".")
        if not name.startswith(start) or len(owner) < 3 or owner[0] != host or not owner[1].isdigit():
            continue
        if not os.path.exists(f"/proc/{owner[1]}"):
            warn(f"removing {os.path.join(folder, name)}, left by a conversion that was killed")
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def prepare_universal(path: str, ctx, scratch: str | None = None) -> str:
    """Rank 0 converts `path` to the universal format (or checks an earlier conversion); the others wait for
    its word on disk, not in a collective: converting a large checkpoint can outlast any collective timeout
    (dist.timeout_s). The word is a file named by a token of this job's, so a conversion that an earlier job
    left (and rank 0 may find damaged and make again) is not taken for it. Should rank 0 die meanwhile,
    torchrun (or srun) ends the others. Returns where the universal form is (universal_dir)."""
    token = [secrets.token_hex(8) if ctx.is_rank0 else None]
    dist.broadcast_object_list(token, src=0)
    target = universal_dir(path, scratch)
    ready = os.path.join(target, f"ready.{token[0]}")
    if ctx.is_rank0:
        convert_to_universal(path, target)
        open(ready, "w").close()
    else:
        while not os.path.isfile(ready):
            time.sleep(0.5)
    dist.barrier()
    if ctx.is_rank0:
        os.remove(ready)
    return target
