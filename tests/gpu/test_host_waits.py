"""On CUDA: a training step waits for the GPU once, at its end, and never synchronizes the whole device (the CPU
test, tests/distributed/test_host_waits.py, says why). Here torch's sync debug mode also sees the waits inside
ops, which a CPU cannot show. One rank, bf16, the tiny model on random tokens."""

import os

import numpy as np

from tests.distributed.common import overrides, write_prepared
from tests.distributed.launcher import ROOT, run_configs
from tests.distributed.test_host_waits import STEPS


def test_a_training_step_waits_for_the_gpu_once(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 8192, 200_000)
    data = write_prepared(tmp_path / "data", {"train": tokens, "val": tokens[:20_000]}, 8192)
    runs = [overrides(tmp_path, f"zero{stage}", f"train.steps={STEPS}", f"data.path={data}", "train.precision=bf16",
                      f"zero.stage={stage}") for stage in (0, 1)]
    results = run_configs(1, runs, tmp_path, worker=os.path.join(ROOT, "tests", "distributed", "host_waits_worker.py"))
    for stage, result in enumerate(results):
        waits = result["host_waits"]
        assert waits["device_syncs"] == {}, f"zero{stage}: device-wide synchronize in a step: {waits['device_syncs']}"
        if stage == 0:  # ZeRO-1's optimizer (DeepSpeed's) reads its overflow flag and norm on the host
            assert sum(waits["cuda_syncs"].values()) <= STEPS, f"zero0: waits for the GPU in {STEPS} steps: {waits}"
