"""Every TP/SP mapping, forward and backward, against closed forms on 2 and 4 gloo ranks."""

import os
import subprocess

import pytest

from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, torchrun_cmd


@pytest.mark.parametrize("nproc", [2, 4])
def test_mappings_match_closed_forms(nproc):
    proc = subprocess.run(
        torchrun_cmd(nproc, os.path.join(ROOT, "tests/distributed/mappings_worker.py")),
        env=rank_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    clean_shared_memory()
    assert proc.returncode == 0, proc.stderr[-3000:]
