"""Each rank builds only its share (model/build.py), on 2 gloo ranks: TP shards of a meta build equal the
whole model's shards and, gathered, the tp=1 model's, bitwise (both flavours, SP on/off, pp 1 and 2, vpp 1 and
2); ZeRO-3 partitions made while building equal those DeepSpeed makes from the whole model. Exact equality,
no tolerance: both routes draw the same keyed init and only slice or copy it (tests/distributed/build_worker.py).
The pipeline cut alone is checked in one process in tests/unit/test_model_build.py."""

import os
import subprocess

from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, torchrun_cmd


def test_meta_build_equals_sharding_the_whole_model():
    proc = subprocess.run(
        torchrun_cmd(2, os.path.join(ROOT, "tests/distributed/build_worker.py")),
        env=rank_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    clean_shared_memory()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp shards: meta build" in proc.stdout and "zero3: partitioned while built" in proc.stdout, proc.stdout
