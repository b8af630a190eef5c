"""Stop signals sent for real to the worker processes of a 2-rank torchrun job (megatron_lite/faults/stop.py):

- at start-up, as soon as the workers have installed their handlers (read from /proc: SigCgt), long before
  training: exit code 0, no traceback, nothing saved;
- mid-run, SIGUSR1 to one rank only, twice: every rank stops at the next step boundary with a checkpoint of
  that step, exit code 0, no traceback; the resumed run continues the step numbers and the uninterrupted
  run's losses and grad norms (1e-6);
- SIGTERM to both ranks the moment a periodic checkpoint's directory appears (during its save): that
  checkpoint completes, the stop checkpoint follows at the next step boundary, and both verify against
  their manifests;
- SIGTERM over and over while a finished one-process run exits: exit code 0.
"""

import json
import os
import signal
import subprocess
import sys
import time

from megatron_lite.checkpoint import store
from tests.distributed.common import overrides
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, run_configs, torchrun_cmd
from tests.distributed.test_resume import assert_continues

TRAIN = os.path.join(ROOT, "train.py")
LONG = ["train.steps=60", "train.log_interval=1"]


def workers(proc: subprocess.Popen, n: int = 2, timeout: float = 120) -> list[int]:
    """The pids of torchrun's n worker processes, once each has installed its SIGUSR1 handler."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            pids = [int(p) for p in f.read().split()]
        if len(pids) == n and all(_catches_usr1(p) for p in pids):
            return pids
        time.sleep(0.01)
    raise AssertionError(f"torchrun did not start {n} workers with handlers within {timeout} s")


def _catches_usr1(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return False
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)


def launch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(torchrun_cmd(2, TRAIN, *args), env=rank_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        clean_shared_memory()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return out, err


def logged_steps(run_dir: str) -> list[int]:
    if not os.path.exists(f"{run_dir}/metrics.jsonl"):
        return []
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_signal_during_start_up_exits_cleanly(tmp_path):
    proc = launch(overrides(tmp_path, "early", *LONG, "checkpoint.interval=1"))
    for pid in workers(proc):
        os.kill(pid, signal.SIGUSR1)
    out, _ = finish(proc)
    assert "stop signal during start-up" in out
    assert logged_steps(f"{tmp_path}/early") == []
    assert store.latest_checkpoint(f"{tmp_path}/early/checkpoints") is None


def test_signal_mid_run_saves_at_the_next_step_boundary_and_resumes(tmp_path):
    run_dir = f"{tmp_path}/run"
    proc = launch(overrides(tmp_path, "run", *LONG, "checkpoint.interval=0"))
    pids = workers(proc)
    while len(logged_steps(run_dir)) < 3:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(pids[1], signal.SIGUSR1)
    time.sleep(0.05)
    os.kill(pids[1], signal.SIGUSR1)  # a second signal, likely during the save
    out, _ = finish(proc)
    last = logged_steps(run_dir)[-1]
    assert f"stop signal: saved at step {last}" in out
    ckpt = f"{run_dir}/checkpoints"
    assert store.latest_checkpoint(ckpt) == os.path.join(ckpt, store.step_name(last))
    assert store.verify(store.latest_checkpoint(ckpt), checksums=True) is None

    straight, resumed = run_configs(2, [overrides(tmp_path, "straight", *LONG),
                                        overrides(tmp_path, "run", *LONG, "checkpoint.resume=auto")], tmp_path)
    assert logged_steps(run_dir) == list(range(1, 61))
    assert_continues(resumed, straight, 1e-6, f"resumed after a stop at step {last}")


def test_sigterm_during_a_save_completes_it_and_stops_after(tmp_path):
    run_dir, ckpt = f"{tmp_path}/save", f"{tmp_path}/save/checkpoints"
    proc = launch(overrides(tmp_path, "save", *LONG, "checkpoint.interval=3", "checkpoint.keep=0"))
    pids = workers(proc)
    target = os.path.join(ckpt, store.step_name(3))
    while not os.path.isdir(target):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.002)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    finish(proc)
    last = logged_steps(run_dir)[-1]
    assert last == 4, last  # the signal came during step 3's save: the stop is at step 4's boundary
    for step in (3, 4):
        assert store.verify(os.path.join(ckpt, store.step_name(step)), checksums=True) is None
    assert store.latest_checkpoint(ckpt) == os.path.join(ckpt, store.step_name(4))


def test_stop_signals_while_a_finished_run_exits_change_nothing(tmp_path):
    """SIGTERM every 2 ms from the moment a one-process run has written its last checkpoint until it has exited
    (a scheduler stopping a job that is just finishing): exit code 0 every time. While the interpreter shuts down
    Python puts the default action back, and such a signal used to kill the finished run with 143 (measured: 6 of 6
    tries), which torchrun and Slurm take for a crash; train.py now ignores stop signals once the run returned."""
    for attempt in range(3):
        args = overrides(tmp_path, f"exit{attempt}", "train.steps=2", "train.eval_interval=0")
        proc = subprocess.Popen([sys.executable, TRAIN, *args], env=rank_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("saved "):  # the last step's checkpoint: the run is over, the process exits
                    break
            while proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
            rest = proc.stdout.read()
        finally:
            proc.kill()
            clean_shared_memory()
        assert proc.wait() == 0, (attempt, proc.returncode, rest[-2000:])
