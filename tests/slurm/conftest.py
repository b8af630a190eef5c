import os
import shutil
import tempfile

import pytest

from tests.slurm.cluster import Cluster, unavailable


@pytest.fixture(scope="session")
def cluster():
    """A two-node Slurm cluster on localhost for the session; skipped, with the reason, where it cannot run.
    Its directory is outside pytest's (root-only) tmp tree: munged runs as the munge user and must reach it."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    scratch = tempfile.mkdtemp(prefix="megatron_lite_slurm_")
    os.chmod(scratch, 0o755)
    c = Cluster(scratch)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(scratch, ignore_errors=True)
