"""Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton
is first imported (DeepSpeed imports it too), so it is set here, ahead of every test module."""

import os
import shutil

import pytest

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
