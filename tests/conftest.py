"""Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton
is first imported (DeepSpeed imports it too), so it is set here, ahead of every test module."""

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _session_scratch():
    """Remove the TMPDIR this session gave its subprocesses (tests/distributed/launcher.py) when it ends."""
    yield
    from tests.distributed.launcher import SCRATCH

    shutil.rmtree(SCRATCH, ignore_errors=True)
