"""Checkpoints on disk: names, the commit, what `resume=auto` picks, pruning. No DeepSpeed here (sharded.py
writes and reads the contents).

  ${checkpoint.dir}/step_<NNNNNNN>/   every rank's shards, then meta.json, written last by rank 0
  ${checkpoint.dir}/latest            the committed step directory's name

Commit: (1) every rank writes its shards; (2) every rank fsyncs the files in the step directory (on a shared
file system only the writer's fsync persists its data, and a rank does not know which files DeepSpeed gave it);
(3) the ranks checksum the files between them (file i by rank i mod world) and rank 0 writes meta.json with the
manifest (size and CRC-32 of every file), fsynced, and fsyncs the directory; (4) rank 0 replaces `latest`
(tmp + fsync + rename + fsync of checkpoint.dir). `latest` therefore only ever names a checkpoint whose every
byte reached the disk. A directory without meta.json was never committed.

Resume (`checkpoint.resume=auto`): the directory `latest` names, then every older complete checkpoint, newest
first; the first whose files match its manifest wins (each rank checksums a share, all agree), and each one
skipped is named with the reason. A dangling `latest` (the directory is gone) falls back the same way. If
checkpoints exist but none verifies, that is an error naming them, never a silent start from step 0.

Nothing complete is deleted except by keep-N pruning of checkpoints older than the one just committed; a
checkpoint that failed verification is renamed aside (`.corrupt`), not deleted, when the run writes that step again.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
import zlib

LATEST = "latest"
META = "meta.json"
UNIVERSAL = "universal"  # sub-directory holding the DP-independent conversion (not part of the manifest)
_STEP = re.compile(r"^step_(\d{7,})$")  # zero-padded to 7 digits; step 10,000,000 on takes more
_CHUNK = 16 << 20


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: str) -> int | None:
    m = _STEP.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


META_CRC = "meta_crc32"


def meta_text(meta: dict) -> str:
    """meta.json's text: the fields and a CRC-32 of them (meta_crc32), so that a damaged field (a step, the
    samples consumed) is found as a damaged shard is, rather than resumed from."""
    body = {k: v for k, v in meta.items() if k != META_CRC}
    return json.dumps(dict(body, **{META_CRC: _meta_crc(body)}), indent=1, default=str)


def _meta_crc(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())


def meta_problem(path: str) -> str | None:
    """The problem with a step directory's meta.json (unreadable, or not matching its own CRC-32); None if sound
    or if it predates the CRC (2026-11-28)."""
    file = os.path.join(path, META)
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as err:
        return f"{file} cannot be read ({err})"
    if not isinstance(meta, dict):
        return f"{file} is not a JSON object"
    if META_CRC in meta and _meta_crc({k: v for k, v in meta.items() if k != META_CRC}) != meta[META_CRC]:
        return f"{file} fails its CRC-32 check (corrupted)"
    return None


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


# --- durability ---------------------------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync persists the names in it: a rename, a new file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, text: str) -> None:
    """Write text to path so that a crash leaves either the old or the new file, both on disk."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


SHARE_PREFIX = ".share_rank"  # a rank's manifest share during an asynchronous save (writer.py)


def shard_files(path: str) -> list[str]:
    """Every file of a step directory that the manifest covers (relative paths, sorted): all but meta.json and
    the universal conversion, which is derived and re-made when missing."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not (dirpath == path and d.startswith(UNIVERSAL)))
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != META and ".tmp." not in name and not name.startswith(SHARE_PREFIX):
                out.append(rel)
    return sorted(out)


def fsync_tree(path: str) -> None:
    """fsync every file and directory of a step directory (the caller's writes among them)."""
    for rel in shard_files(path):
        fsync_path(os.path.join(path, rel))
    for dirpath, _, _ in os.walk(path):
        fsync_path(dirpath)


def digest(path: str) -> list[int]:
    """[size, CRC-32] of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return [size, crc]


def manifest_share(path: str, rank: int, world: int) -> dict:
    """{file: [size, crc32]} for this rank's share of the step directory's files (file i goes to rank i % world)."""
    return {rel: digest(os.path.join(path, rel)) for i, rel in enumerate(shard_files(path)) if i % world == rank}


def verify_share(path: str, manifest: dict, rank: int, world: int, checksums: bool = True) -> str | None:
    """The first problem with this rank's share of the manifest's files, as one phrase; None if they match."""
    for i, (rel, (size, crc)) in enumerate(sorted(manifest.items())):
        if i % world != rank:
            continue
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"{file} is missing"
        got = os.path.getsize(file)
        if got != size:
            return f"{file} has {got} bytes, the manifest says {size} (truncated or rewritten)"
        if checksums and digest(file)[1] != crc:
            return f"{file} fails its CRC-32 check (corrupted)"
    return None


def verify(path: str, checksums: bool = False) -> str | None:
    """One process: the first problem with a committed checkpoint (sizes only unless checksums); None if sound
    or if it predates manifests."""
    if not is_complete(path):
        return f"{os.path.join(path, META)} is missing (never committed)"
    problem = meta_problem(path)
    if problem is not None:
        return problem
    manifest = read_meta(path).get("manifest")
    return None if manifest is None else verify_share(path, manifest, 0, 1, checksums)


# --- choosing what to resume --------------------------------------------------------------------------------


def complete_steps(root: str) -> list[str]:
    """Committed step directories under root, oldest first."""
    return sorted((p for p in _step_dirs(root) if is_complete(p)), key=step_of)


def _step_dirs(root: str) -> list[str]:
    """Every step_<N> directory under root (N of 7 digits or more)."""
    return [p for p in glob.glob(os.path.join(root, "step_*")) if step_of(p) is not None and os.path.isdir(p)]


def latest_name(root: str) -> str | None:
    """The name `latest` holds; None when it is missing or cannot be read as a name (_read_latest says why)."""
    return _read_latest(root)[0]


def _read_latest(root: str) -> tuple[str | None, str | None]:
    """(the name `latest` holds, why it holds none that can be used): garbage bytes, a directory, a symlink loop."""
    file = os.path.join(root, LATEST)
    try:
        with open(file, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{file} cannot be read ({type(err).__name__}: {err})"
    if step_of(name) is None:
        return None, f"{file} holds {name[:40]!r}, not a step directory's name"
    return name, None


def latest_checkpoint(root: str) -> str | None:
    """The step directory `latest` names, if it is complete; None when there is none."""
    name = latest_name(root)
    path = os.path.join(root, name) if name else None
    return path if path and is_complete(path) else None


def resume_candidates(root: str) -> tuple[list[str], list[str]]:
    """(checkpoints to try for resume=auto, best first; notes on `latest` when it does not name the newest).
    Every committed checkpoint (meta.json is written only once every rank's files are durable and checksummed),
    newest first. `latest` follows the commit; where it names an older one (a crash between meta.json and
    `latest`, or an edited or damaged `latest`), the newer ones are still candidates: a commit is sound whatever
    `latest` says, and a run that passed them over would rename them aside as unsound on reaching their steps."""
    name, problem = _read_latest(root)
    notes = [problem] if problem else []
    steps = complete_steps(root)
    if name is not None:
        target, file = os.path.join(root, name), os.path.join(root, LATEST)
        if not os.path.isdir(target):
            notes.append(f"{file} names {name}, which does not exist")
        elif not is_complete(target):
            notes.append(f"{file} names {name}, which has no {META}")
        newer = [os.path.basename(p) for p in steps if step_of(p) > step_of(name)]
        if newer:
            notes.append(f"{file} names {name}, older than the committed {', '.join(newer)}")
    return list(reversed(steps)), notes


def uncommitted_leftovers(root: str) -> list[str]:
    """Step directories without meta.json (a write that never committed)."""
    return sorted((p for p in _step_dirs(root) if not is_complete(p)), key=step_of)


def newer_checkpoints(root: str, step: int) -> list[str]:
    """Committed checkpoints under root after `step` (a resume from `step` would reach and replace them)."""
    return [p for p in complete_steps(root) if step_of(p) > step]


# --- writing and pruning ----------------------------------------------------------------------------------


def clear_for_write(path: str) -> str | None:
    """Before writing step directory `path`: an uncommitted leftover is removed; a committed one (a checkpoint
    resume=auto passed over as unsound, or one left by a run before checkpoint.resume=never) is renamed aside,
    never deleted. Returns the new name."""
    if not os.path.exists(path):
        return None
    if not is_complete(path):
        shutil.rmtree(path)
        return None
    return set_aside(path, "corrupt")


def set_aside(path: str, label: str) -> str:
    """Rename a committed step directory to `<path>.<label>.<time>` (no longer a resume candidate, nor pruned)."""
    aside = f"{path}.{label}.{int(time.time())}"
    n = 1
    while os.path.exists(aside):  # set aside twice within a second: never onto the one set aside before
        aside, n = f"{path}.{label}.{int(time.time())}.{n}", n + 1
    os.replace(path, aside)
    return aside


def prune(root: str, keep: int, committed: int) -> list[str]:
    """Delete committed checkpoints older than the newest `keep` up to step `committed`, and uncommitted
    leftovers older than it; never anything after `committed`. Returns what was deleted."""
    if keep <= 0:
        return []
    done = [p for p in complete_steps(root) if step_of(p) <= committed]
    doomed = done[:-keep] + [p for p in uncommitted_leftovers(root) if step_of(p) < committed]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
