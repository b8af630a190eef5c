"""Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton
is first imported (DeepSpeed imports it too), so it is set here, ahead of every test module.

DeepSpeed's async I/O op (NVMe offload) takes ~7 minutes to build on 2 cores, longer than the other two CPU ops
together, and only the tests that ask for the `async_io_op` fixture need it. So `make test` does not build it up
front: when such a test is selected, the session moves it to the end and builds the op meanwhile on the cores'
idle time (tools/build_ops.py --idle; the test runs keep the cores busy ~75% of the time). The fixture waits for
that build."""

import os
import shutil
import subprocess
import sys
import tempfile
from typing import IO

import pytest

_async_io_build: tuple[subprocess.Popen, IO[bytes]] | None = None
# The build alone takes ~7 minutes here; its test's timeout (tests/distributed/test_zero.py) leaves room after it,
# so a build that hangs fails with its own log, not with pytest-timeout's stack dump.
BUILD_WAIT_S = 1200

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
    global _async_io_build
    late = [item for item in items if "async_io_op" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in late] + late
    if not late or config.option.collectonly:
        return
    from tests.distributed.launcher import ROOT

    log = tempfile.TemporaryFile()
    build = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "build_ops.py"), "--idle", "AsyncIOBuilder"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _async_io_build = build, log


@pytest.fixture(scope="session")
def async_io_op():
    """DeepSpeed's async I/O op, built: waits for the build this session started in the background."""
    assert _async_io_build is not None, "every selected test that uses async_io_op starts the build at collection"
    build, log = _async_io_build
    try:
        returncode = build.wait(timeout=BUILD_WAIT_S)
    except subprocess.TimeoutExpired:
        returncode = None
    log.seek(0)
    outcome = f"did not end within {BUILD_WAIT_S} s of waiting" if returncode is None else f"failed (exit {returncode})"
    assert returncode == 0, f"building DeepSpeed's async I/O op {outcome}:\n{log.read().decode(errors='replace')[-4000:]}"


def pytest_sessionfinish(session):
    """A background build the session no longer needs (its test failed to be reached, or Ctrl-C) is stopped
    cleanly: build_ops turns SIGTERM into an exit that releases torch's build lock."""
    if _async_io_build is not None and _async_io_build[0].poll() is None:
        _async_io_build[0].terminate()
        _async_io_build[0].wait(timeout=120)
