"""faults/run_lock.py: one run per run.dir; the lock goes with its holder however that ends."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.errors import RunError
from megatron_lite.faults.run_lock import RunDirLock

HOLD = "import sys, time; from megatron_lite.faults.run_lock import RunDirLock; RunDirLock(sys.argv[1]); " \
       "print('held', flush=True); time.sleep(60)"


def test_a_second_run_on_a_run_dir_is_refused_until_the_first_is_gone(tmp_path):
    first = RunDirLock(str(tmp_path / "run"))
    with pytest.raises(RunError, match=rf"^run.dir={tmp_path}/run is in use by another run \(host \S+, pid "
                                       rf"{os.getpid()}, since .*\): two runs on one run.dir"):
        RunDirLock(str(tmp_path / "run"))
    first.release()
    RunDirLock(str(tmp_path / "run")).release()
    # a holder killed with SIGKILL leaves no lock behind (a restart takes it at once)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunError, match=rf"pid {holder.pid}"):
        RunDirLock(str(tmp_path / "run"))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    time.sleep(0.1)
    RunDirLock(str(tmp_path / "run")).release()
