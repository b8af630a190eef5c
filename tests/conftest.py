"""Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton
is first imported (DeepSpeed imports it too), so it is set here, ahead of every test module.

Two things only one test each needs take minutes of one core each: DeepSpeed's async I/O op (NVMe offload) takes
~7 minutes to build on 2 cores, longer than the other two CPU ops together; the offline install (a wheelhouse, a
clone, `make install` without the network) ~2 minutes of pip. So `make test` does not do them in line: when a test
asking for the fixture below is selected, the session moves it to the end and starts the job at collection, on the
cores' idle time (SCHED_IDLE: tools/build_ops.py --idle, tests/install/offline_install.py --idle; the tests keep the
cores busy ~80% of the time). The fixture waits for its job."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import IO

import pytest

# The async I/O build alone takes ~7 minutes here; its test's timeout (tests/distributed/test_zero.py) leaves room
# after it, so a job that hangs fails with its own log, not with pytest-timeout's stack dump.
BUILD_WAIT_S = 1200
OFFLINE_INSTALL = os.path.join(tempfile.gettempdir(), f"megatron_lite_offline_install_{os.getpid()}")


def _background_jobs(root: str) -> dict[str, list[str]]:
    """fixture -> the command of the background job it waits for."""
    return {
        "async_io_op": [sys.executable, os.path.join(root, "tools", "build_ops.py"), "--idle", "AsyncIOBuilder"],
        "offline_install": [
            sys.executable,
            os.path.join(root, "tests", "install", "offline_install.py"),
            "--idle",
            OFFLINE_INSTALL,
        ],
    }


_background: dict[str, tuple[subprocess.Popen, IO[bytes]]] = {}

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _session_scratch():
    """End the pool's worlds (tests/distributed/pool.py) and remove the TMPDIR this session gave its subprocesses
    (tests/distributed/launcher.py) when it ends."""
    yield
    from tests.distributed import pool
    from tests.distributed.launcher import SCRATCH, clean_shared_memory

    pool.close_all()
    clean_shared_memory()  # the DeepSpeed buffers the pool's ranks held

    shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    from tests.distributed.launcher import ROOT

    jobs = _background_jobs(ROOT)
    late = [item for item in items if set(jobs) & set(getattr(item, "fixturenames", ()))]
    items[:] = [item for item in items if item not in late] + late
    if config.option.collectonly:
        return
    for name in sorted({f for item in late for f in item.fixturenames if f in jobs}):
        log = tempfile.TemporaryFile()
        job = subprocess.Popen(jobs[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _background[name] = job, log


def _wait(name: str) -> None:
    """Wait for the background job of fixture `name`; fail with its output if it fails or does not end."""
    assert name in _background, f"every selected test that uses {name} starts its job at collection"
    job, log = _background[name]
    try:
        returncode = job.wait(timeout=BUILD_WAIT_S)
    except subprocess.TimeoutExpired:
        returncode = None
    log.seek(0)
    outcome = f"did not end within {BUILD_WAIT_S} s of waiting" if returncode is None else f"failed (exit {returncode})"
    assert returncode == 0, f"the background job of {name} {outcome}:\n{log.read().decode(errors='replace')[-4000:]}"


@pytest.fixture(scope="session")
def async_io_op():
    """DeepSpeed's async I/O op, built: waits for the build this session started in the background."""
    _wait("async_io_op")


@pytest.fixture(scope="session")
def offline_install() -> dict:
    """What the offline install's steps recorded (tests/install/offline_install.py), run in the background."""
    _wait("offline_install")
    with open(os.path.join(OFFLINE_INSTALL, "steps.json")) as f:
        return json.load(f)


def pytest_sessionfinish(session):
    """A background job the session no longer needs (its test failed to be reached, or Ctrl-C) is stopped with its
    process group (each job started a session of its own): build_ops turns SIGTERM into an exit that stops its
    compilers and releases torch's build lock; pip and make end. The offline install's folder goes."""
    for job, _ in _background.values():
        if job.poll() is None:
            try:
                os.killpg(job.pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass
            job.wait(timeout=120)
    shutil.rmtree(OFFLINE_INSTALL, ignore_errors=True)
