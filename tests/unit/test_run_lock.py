"""faults/run_lock.py: one run per run.dir; the lock goes with its holder however that ends."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.errors import RunError
from megatron_lite.faults.run_lock import RunDirLock
from megatron_lite.parallel.context import free_port
from tests.distributed.launcher import ROOT, rank_env

HOLD = (
    "import sys, time; from megatron_lite.faults.run_lock import RunDirLock; RunDirLock(sys.argv[1]); "
    "print('held', flush=True); time.sleep(60)"
)


def test_a_second_run_on_a_run_dir_is_refused_until_the_first_is_gone(tmp_path):
    first = RunDirLock(str(tmp_path / "run"))
    with pytest.raises(
        RunError,
        match=rf"^run.dir={tmp_path}/run is in use by another run \(host \S+, pid "
        rf"{os.getpid()}, since .*\): two runs on one run.dir",
    ):
        RunDirLock(str(tmp_path / "run"))
    first.release()
    RunDirLock(str(tmp_path / "run")).release()
    # a holder killed with SIGKILL leaves no lock behind (a restart takes it at once)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunError, match=rf"pid {holder.pid}"):
        RunDirLock(str(tmp_path / "run"))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    time.sleep(0.1)
    RunDirLock(str(tmp_path / "run")).release()


def test_every_rank_of_a_refused_run_ends_with_exit_3(tmp_path):
    """Two ranks started as Slurm starts them (no torchrun: rank 0 serves the rendezvous) on a run.dir another run
    holds: both end with exit 3 and one error line between them. Only rank 0 tries the lock; before it joined the
    process group to pass the refusal on, rank 1 waited to connect until killed (and Slurm requeued the job)."""
    held = RunDirLock(str(tmp_path / "run"))
    try:
        port = str(free_port())
        ranks = [
            subprocess.Popen(
                [sys.executable, "train.py", f"run.dir={tmp_path}/run", "logging.wandb.mode=disabled"],
                cwd=ROOT,
                env=rank_env(
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        try:
            outs = [rank.communicate(timeout=120) for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        errors = [line for out, err in outs for line in (out + err).splitlines() if line.startswith("error:")]
        assert [rank.returncode for rank in ranks] == [3, 3], outs
        assert len(errors) == 1 and errors[0].startswith(
            f"error: run.dir={tmp_path}/run is in use by another run (host"
        ), errors
    finally:
        held.release()
