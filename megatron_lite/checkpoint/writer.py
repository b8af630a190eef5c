"""checkpoint.async: a save blocks the loop only while its tensors are copied to host memory; a background
thread writes, fsyncs and checksums them, and rank 0 commits once every rank's files are durable.

The protocol is the synchronous one (checkpoint.save, checkpoint/store.py), moved off the loop:
1. foreground, collective: DeepSpeed's save_checkpoint runs with a staging engine (Engine.save_staged), which
   copies each state dict it is given to host memory (pinned on a GPU) instead of writing it; the RNG streams are
   taken too. This is `ckpt_block_s`.
2. background, per rank: torch.save every staged file, fsync it and its directory, then write this rank's
   manifest share ({file: [size, CRC-32]}) as `.share_rank<r>.json` (atomically).
3. background, every rank: a monitored barrier on a gloo group of the writers' own (`checkpoint_group`), once
   its share is written. A rank that died has closed its connections, so the barrier fails at once on the
   others, and so does their next wait(): the job ends and restarts instead of waiting dist.timeout_s for the
   share, with the loop blocked in wait() where a stop signal only sets a flag (rank 0 would sit there until
   torchrun's SIGKILL, 30 s after it was told to stop). A rank that hung times the barrier out.
4. background, rank 0: wait until every rank's share exists (a rank whose write failed writes none: rank 0
   gives up after dist.timeout_s and commits nothing), write meta.json with the merged manifest, move `latest`,
   prune. Steps 2 to 4 are `ckpt_write_s`.
A crash or SIGKILL anywhere before `latest` moves leaves the previous checkpoint as `latest`; the half-written
directory has no meta.json, so resume passes it over. At most one save is in flight per rank: the next waits for
it (and says so), as do a stop signal and the end of training (`wait`), so a run never exits with a save half done.
The staged copy costs host memory equal to this rank's checkpoint until its write ends.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.store import SHARE_PREFIX


class HostPool:
    """Host buffers for staging, kept from one save to the next: the first save allocates (and faults in) one
    checkpoint's worth of host memory, pinned on a GPU; later saves copy into the same pages (on a CPU this
    halved the blocking time of a gpt2-350m save). Used by one thread at a time: the loop stages only after the
    previous write has ended and handed its buffers back."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype, pin))
        return free.pop() if free else torch.empty(shape, dtype=dtype, pin_memory=pin)

    def give(self, obj) -> None:
        seen = set()

        def walk(o):
            if isinstance(o, torch.Tensor):
                if id(o) not in seen:
                    seen.add(id(o))
                    self._free.setdefault((tuple(o.shape), o.dtype, o.is_pinned()), []).append(o)
            elif isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    walk(v)

        walk(obj)


def to_host(obj, pin: bool, pool: HostPool | None = None, memo: dict | None = None):
    """A copy of a (nested) state dict with every tensor copied to host memory, aliasing kept; other leaves as is
    (DeepSpeed's state dicts hold numbers, strings and small lists beside tensors, which nothing mutates)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            t = obj.detach()
            pinned = pin and t.is_cuda
            host = (
                pool.take(t.shape, t.dtype, pinned)
                if pool is not None
                else torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            )
            memo[id(obj)] = host.copy_(t, non_blocking=pinned)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, to_host(v, pin, pool, memo)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_host(v, pin, pool, memo) for v in obj)
    return obj


def write_file(obj, path: str) -> None:
    """torch.save then fsync: the file's bytes are on disk when this returns."""
    torch.save(obj, path)
    store.fsync_path(path)


def _share_path(path: str, rank: int) -> str:
    return os.path.join(path, f"{SHARE_PREFIX}{rank:05d}.json")


class AsyncWriter:
    """One background save at a time for this rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, commit_timeout_s: float, log: Callable[[str], None], group=None):
        """group: checkpoint_group()'s, for the barrier of step 3 (None: no barrier, rank 0 only waits for the
        shares, as in one process that plays several ranks)."""
        self.rank, self.world, self.commit_timeout_s, self.log = rank, world, commit_timeout_s, log
        self.group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pool = HostPool()  # the staging buffers, back here after each write
        self.step: int | None = None  # the save in flight (or last finished)
        self.write_s: float | None = None  # its background time, once done

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, path: str, step: int, files: list[tuple[str, object]], commit: Callable[[dict], None] | None
    ) -> None:
        """Start writing `files` [(path, object)] of step directory `path`; rank 0 passes `commit` (called with
        the merged manifest once every rank's share is there)."""
        assert not self.busy(), "one save in flight: wait() first"
        self.step, self.write_s, self._error = step, None, None
        self._thread = threading.Thread(
            target=self._run, args=(path, files, commit), daemon=True, name=f"checkpoint-writer-step-{step}"
        )
        self._thread.start()

    def wait(self, reason: str = "") -> float | None:
        """Block until the save in flight is written (and, on rank 0, committed); its write time. Re-raises a
        failure of the background write here, in the training loop."""
        if self._thread is None:
            return None
        if self._thread.is_alive() and reason:
            self.log(f"{reason}: waiting for the checkpoint of step {self.step}, still being written")
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"the background write of the checkpoint of step {self.step} failed: {error!r}; "
                "the previous checkpoint stays `latest`"
            ) from error
        return self.write_s

    def close(self) -> None:
        """Shut down the group (after the last wait(); a gloo group keeps threads until it is shut down)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def finished(self) -> float | None:
        """The write time of a save that has ended since the last call (None while one runs or none ended)."""
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return None

    def _run(self, path: str, files: list[tuple[str, object]], commit) -> None:
        t0 = time.perf_counter()
        try:
            share = {}
            for file, obj in files:
                os.makedirs(os.path.dirname(file), exist_ok=True)
                write_file(obj, file)
                share[os.path.relpath(file, path)] = store.digest(file)
            for dirpath, _, _ in os.walk(path):
                store.fsync_path(dirpath)
            store.atomic_write(_share_path(path, self.rank), json.dumps(share))
            if self.group is not None:
                dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=self.commit_timeout_s))
            if commit is not None:
                commit(self._gather_shares(path))
            self.write_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - handed to the loop by wait()
            self._error = e
        finally:
            self.pool.give([obj for _, obj in files])

    def _gather_shares(self, path: str) -> dict:
        """Rank 0: every rank's share, merged, plus the files no rank staged (DeepSpeed's NVMe offload copies and
        recovery script, written in the foreground); raises if a share is missing after the timeout."""
        deadline = time.monotonic() + self.commit_timeout_s
        missing = list(range(self.world))
        while missing:
            missing = [r for r in missing if not os.path.exists(_share_path(path, r))]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {missing} wrote no manifest share in {path} within "
                    f"{self.commit_timeout_s:.0f} s (dist.timeout_s): not committed"
                )
            if missing:
                time.sleep(0.05)
        manifest = {}
        for r in range(self.world):
            with open(_share_path(path, r)) as f:
                manifest.update(json.load(f))
        for rel in store.shard_files(path):
            if rel not in manifest:
                manifest[rel] = store.digest(os.path.join(path, rel))
        return manifest


def checkpoint_group(timeout_s: float):
    """A gloo group of every rank for the writers' barriers, which run in their background threads: a group of
    their own, as collectives of one group must come in the same order on every rank (called by every rank, like
    any new_group). None in a world of one."""
    if dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def remove_shares(path: str) -> None:
    """After the commit: the shares are in meta.json's manifest."""
    for name in os.listdir(path):
        if name.startswith(SHARE_PREFIX):
            os.remove(os.path.join(path, name))
