"""A build killed while it held torch's extension lock must not hang every later run (engine/build_locks.py).

The locks here are taken by torch's own FileBaton in a child process, and the child is killed with SIGKILL, as
an out-of-memory kill or the end of a machine's session kills a build."""

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.utils.file_baton import FileBaton

from megatron_lite.engine.build_locks import clear_stale_build_locks, holders


@pytest.fixture
def op_folder(tmp_path):
    folder = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    folder.mkdir(parents=True)
    for name in ("build.ninja", "shm.o"):
        (folder / name).write_text("")
        os.utime(folder / name, (time.time() - 3600,) * 2)  # built an hour ago
    return folder


def take_lock(lock: str) -> subprocess.Popen:
    """A child that takes the lock as torch's extension build does and keeps it until killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from torch.utils.file_baton import FileBaton; "
            f"assert FileBaton({lock!r}).try_acquire(); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_killed_builders_lock_is_removed_and_a_held_one_is_kept(tmp_path, op_folder):
    lock = str(op_folder / "lock")
    holder = take_lock(lock)
    try:
        said = []
        assert holders(lock) == [holder.pid]
        assert clear_stale_build_locks(str(tmp_path), quiet_s=60, say=said.append) == []
        assert os.path.exists(lock) and said == [], "a lock whose builder is alive was touched"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(lock) and holders(lock) == [], "SIGKILL leaves the lock behind: what this is about"
    os.utime(lock, (time.time() - 600,) * 2)  # killed ten minutes ago

    said = []
    assert clear_stale_build_locks(str(tmp_path), quiet_s=60, say=said.append) == [lock]
    assert not os.path.exists(lock)
    assert len(said) == 1 and "removed a stale build lock" in said[0] and lock in said[0], said
    assert FileBaton(lock).try_acquire(), "torch could not take the lock again"


def test_a_lock_nobody_here_holds_is_kept_while_its_build_folder_changes(tmp_path, op_folder):
    """A builder this machine cannot see (a shared home on a cluster) still writes objects into the folder: the
    lock is removed only once the folder has stayed unchanged for quiet_s."""
    lock = str(op_folder / "lock")
    holder = take_lock(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    (op_folder / "shm_interface.o").write_text("")  # an object written just now
    last_change = time.time()
    quiet_s = 3.0

    said = []
    assert clear_stale_build_locks(str(tmp_path), quiet_s=quiet_s, say=said.append) == [lock]
    assert time.time() >= last_change + quiet_s, "removed while the folder was still changing"
    assert len(said) == 2 and "waiting on build lock" in said[0] and "removed a stale build lock" in said[1], said


def test_no_lock_means_nothing_to_do(tmp_path, op_folder):
    said = []
    assert clear_stale_build_locks(str(tmp_path), quiet_s=60, say=said.append) == [] and said == []
    assert sorted(os.listdir(op_folder)) == ["build.ninja", "shm.o"]
