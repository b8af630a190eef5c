"""Stop signals sent for real to the worker processes of a 2-rank torchrun job (megatron_lite/faults/stop.py):

- at start-up, as soon as the workers have installed their handlers (read from /proc: SigCgt), long before
  training: exit code 0, no traceback, nothing saved;
- mid-run, SIGUSR1 to one rank only, twice: every rank stops at the next step boundary with a checkpoint of
  that step, exit code 0, no traceback; the resumed run continues the step numbers and the uninterrupted
  run's losses and grad norms (1e-6);
- SIGTERM to both ranks the moment a periodic checkpoint's directory appears (during its save): that
  checkpoint completes, the stop checkpoint follows at the next step boundary, and both verify against
  their manifests;
- SIGTERM over and over while a finished one-process run exits: exit code 0;
- twenty SIGTERMs and SIGUSR1s at random moments of a one-process start-up, to the process or to its whole
  process group (as Slurm's scancel sends them), with wandb off and offline: exit code 0 every time;
- SIGTERM to the process group while DeepSpeed compiles its CPU communication op on a machine's first run (the
  signal stops the compiler too): exit code 0, and the line says what was cut short.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_lite.checkpoint import store
from megatron_lite.engine.build_locks import stat_fields

# the fault tests train on the real corpus (tests/distributed/common.py, real_corpus_overrides)
from tests.distributed.common import real_corpus_overrides as overrides
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
    return subprocess.Popen(
        torchrun_cmd(2, TRAIN, *args),
        env=rank_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


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

    straight, resumed = run_configs(
        2,
        [overrides(tmp_path, "straight", *LONG), overrides(tmp_path, "run", *LONG, "checkpoint.resume=auto")],
        tmp_path,
    )
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
        proc = subprocess.Popen(
            [sys.executable, TRAIN, *args],
            env=rank_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
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


def _signalled_start_up(run_dir: str, delay: float, sig: int, group: bool, env: dict) -> tuple[int, str, float | None]:
    """One run of the tiny model, signalled `delay` seconds after its handlers are installed. Returns its exit
    code, its output, and when (after the handlers) it printed its layout line, the last line of start-up."""
    args = overrides(
        os.path.dirname(run_dir),
        os.path.basename(run_dir),
        "train.steps=4",
        "train.eval_interval=0",
        f"logging.wandb.mode={env['WANDB_MODE']}",
    )
    with open(f"{run_dir}.log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, TRAIN, *args],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 120
            while not _catches_usr1(proc.pid):
                assert proc.poll() is None and time.time() < deadline, "no handler installed"
                time.sleep(0.002)
            installed, signalled, laid_out = time.time(), False, None
            while proc.poll() is None:
                if laid_out is None and ": world " in open(log.name).read():
                    laid_out = time.time() - installed
                if not signalled and time.time() >= installed + delay:
                    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
                    signalled = True
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.kill()
            clean_shared_memory()
        log.seek(0)
        return proc.returncode, log.read(), laid_out


@pytest.mark.slow
def test_twenty_signals_at_random_moments_of_start_up_exit_0(tmp_path):
    """The defect this guards: "stop signal during start-up ... nothing saved", then "terminate called without an
    active exception" and exit code 134 (a crash to torchrun and Slurm), seen in 4 of 16 tries of an earlier build.
    Two lanes run side by side (busy cores, as on a loaded node); each draws its delays over the length of start-up
    it last measured, so the signals fall all over it: imports, DeepSpeed, the model, wandb, the data."""
    rng = random.Random(20261125)
    tries = [(k, rng.choice((signal.SIGTERM, signal.SIGUSR1)), k % 4 >= 2, rng.random()) for k in range(20)]
    results, failures = [], []

    def lane(first: int, wandb_mode: str) -> None:
        start_up = 6.0  # seconds: the shortest start-up this lane has measured
        for k, sig, group, fraction in tries[first::2]:
            delay = fraction * start_up
            code, out, laid_out = _signalled_start_up(
                f"{tmp_path}/try{k}", delay, sig, group, rank_env(WANDB_MODE=wandb_mode, PYTHONUNBUFFERED="1")
            )
            start_up = min(start_up, laid_out or start_up)
            results.append((k, "stop signal during start-up" in out))
            ok = code == 0 and "Traceback" not in out and "terminate called" not in out
            if not ok:
                failures.append(
                    f"try {k} ({signal.Signals(sig).name} to the {'group' if group else 'process'} "
                    f"{delay:.2f} s in, wandb {wandb_mode}): exit {code}\n{out[-1500:]}"
                )

    lanes = [threading.Thread(target=lane, args=(0, "disabled")), threading.Thread(target=lane, args=(1, "offline"))]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    assert not failures, "\n".join(failures)
    assert len(results) == 20
    during = sum(in_start_up for _, in_start_up in results)
    assert during >= 12, f"only {during} of 20 signals landed during start-up: the test no longer tests it"


@pytest.mark.slow
def test_sigterm_to_the_group_while_deepspeed_builds_its_op_exits_0(tmp_path):
    """A machine's first run compiles DeepSpeed's CPU communication op with ninja, a child in the run's process
    group; Slurm's scancel signals the whole group, so the compiler dies and start-up fails with "ninja: build
    stopped: interrupted by user". That used to end as a crash (exit 1, a traceback); it is a stop during start-up."""
    extensions = f"{tmp_path}/torch_extensions"  # empty: the op is built, as on a fresh machine
    env = rank_env(WANDB_MODE="disabled", TORCH_EXTENSIONS_DIR=extensions)
    args = overrides(tmp_path, "build", "train.steps=4")
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not _ninja_running(proc.pid):
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                out = proc.communicate()[0]
                assert "built successfully" not in out, "the build ended before it was seen running"
                pytest.skip("DeepSpeed built no CPU communication op here (no compiler?)")
            time.sleep(0.01)
        time.sleep(0.5)  # well inside the compile (several seconds)
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        clean_shared_memory()
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "start-up was cut short: Error building extension 'deepspeed_shm_comm'" in out, out[-3000:]


def _ninja_running(session: int) -> bool:
    """Whether a ninja process runs in the given session (the run's process group)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = stat_fields(int(pid))
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if name == "ninja" and int(fields[3]) == session:  # field 6 of stat, the session id
            return True
    return False
