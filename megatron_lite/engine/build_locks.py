"""Stale build locks in torch's extension cache, found and removed before DeepSpeed loads its ops.

torch builds and loads every just-in-time extension (DeepSpeed's ops: the CPU accelerator's shared-memory comm op
on every start-up, CPU Adam, async I/O, the CUDA ones) under a lock file, `<cache>/<op>/lock`, created with
O_EXCL and removed when the build or load ends. A process killed with SIGKILL in that window (an out-of-memory
kill, a killed rank, a machine's session ending mid-build) leaves the file behind, and every later run waits on
it forever, silently: torch's wait has no timeout and says nothing. It happened: a test session's background
build was killed, and the next run on that machine hung until its timeout.

A lock is live while its holder keeps it open (torch closes it only to remove it), so a lock file that no
process on this machine has open and whose build folder has not changed for `quiet_s` seconds is stale. The
quiet time covers a holder this machine cannot see (a shared home on a cluster, another container): it keeps
writing objects into the folder while it builds. Cleaners of one folder take turns (flock, released by the kernel
even on SIGKILL), so one cannot remove a lock that another's run has just taken.
"""

from __future__ import annotations

import fcntl
import glob
import os
import time

QUIET_S = 300.0
_TURN = "lock.check"  # the file cleaners of one build folder flock to take turns


def extensions_root() -> str:
    """Where torch puts just-in-time extensions: TORCH_EXTENSIONS_DIR, or its per-user cache folder (whose
    subfolders are per Python version and accelerator)."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def holders(path: str) -> list[int]:
    """The processes on this machine that have `path` open (those whose fds we may read: ours, or all as root)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in fds):
                found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name, which may hold spaces and parentheses: state, ppid, pgrp, session,
    ... (fields 3 on of proc(5))."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a build's ninja and its compile jobs), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _last_change(folder: str) -> float:
    times = []
    for entry in os.scandir(folder):
        if entry.name == _TURN:  # ours: created by the first look
            continue
        try:
            times.append(entry.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            continue
    return max(times, default=0.0)


def _remove_if_stale(lock: str, quiet_s: float) -> str:
    """'gone', 'held' (someone here has it open), 'busy' (no holder here, but its folder changed within quiet_s:
    wait and look again) or 'removed'."""
    folder = os.path.dirname(lock)
    try:
        turn = open(os.path.join(folder, _TURN), "a")
    except OSError:  # a folder we may not write to: we could not remove its lock either; torch decides
        return "held"
    with turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            first = os.stat(lock)
            if holders(lock):
                return "held"
            time.sleep(1.0)  # a holder closes the lock just before removing it: look twice
            if holders(lock) or os.stat(lock).st_ino != first.st_ino:
                return "held"
            if time.time() - _last_change(folder) < quiet_s:
                return "busy"
            os.remove(lock)  # only a cleaner removes a lock it does not hold, and cleaners take turns
            return "removed"
        except FileNotFoundError:
            return "gone"


def clear_stale_build_locks(root: str | None = None, quiet_s: float = QUIET_S, say=print) -> list[str]:
    """Remove the stale locks under `root` (default: torch's extension cache), waiting while a lock with no
    holder here has a build folder that is still changing. Returns the locks removed. Locks that a process here
    holds are left: torch waits for them itself, as it does for every lock on a machine without /proc."""
    if not os.path.isdir("/proc"):  # no way to see a lock's holders here (not Linux): leave every lock to torch
        return []
    root = root or extensions_root()
    removed, told = [], set()
    pending = glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))
    while pending:
        waiting = []
        for lock in pending:
            outcome = _remove_if_stale(os.path.realpath(lock), quiet_s)
            if outcome == "removed":
                stopped = time.time() - _last_change(os.path.dirname(lock))
                say(
                    f"removed a stale build lock {lock}: no process here has it open and its build stopped "
                    f"{stopped:.0f} s ago (a killed build); it will be rebuilt"
                )
                removed.append(lock)
            elif outcome == "busy":
                if lock not in told:
                    say(
                        f"waiting on build lock {lock}: no process here has it open, but its folder changed within "
                        f"{quiet_s:.0f} s (a build elsewhere?); removed once the folder stays unchanged that long"
                    )
                    told.add(lock)
                waiting.append(lock)
        if waiting:
            time.sleep(min(10.0, quiet_s / 10))
        pending = waiting
    return removed
