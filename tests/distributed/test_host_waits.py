"""A training step waits for the device once, at its end (Engine.train_step's one read of the loss and the norm),
and nothing in it synchronizes the whole device. On a GPU a wait inside the step stops the host from queueing
kernels while the device runs, and a device-wide synchronize also waits on the pipeline's pending sends; on a CPU
neither costs anything, so tests/distributed/host_waits_worker.py counts them where they are asked for.

DeepSpeed's throughput timer synchronized the device at every micro-batch's forward and at step() until
ds_config turned it off (3 per step at 2 micro-batches)."""

import os

from tests.distributed.common import overrides
from tests.distributed.launcher import ROOT, run_configs

WORKER = os.path.join(ROOT, "tests", "distributed", "host_waits_worker.py")
STEPS = 3
RUNS = {  # 2 ranks, 8 sequences of 2 per step: 2 micro-batches per step at dp=2, 4 on a pp=2 pipeline
    "zero0": ["zero.stage=0"],
    "zero1": ["zero.stage=1"],
    "zero3": ["zero.stage=3"],
    "pp2_vpp2_zero0": ["parallel.pp=2", "parallel.vpp=2", "zero.stage=0"],
}
ONE_READ = {"megatron_lite/engine/engine.py": STEPS}  # ZeRO-0: the stacked loss and norm, once a step


def test_a_step_waits_for_the_device_once(tmp_path):
    runs = [overrides(tmp_path, name, f"train.steps={STEPS}", *extra) for name, extra in RUNS.items()]
    results = run_configs(2, runs, tmp_path, worker=WORKER)
    for name, result in zip(RUNS, results):
        waits = result["host_waits"]
        assert len(result["losses"]) == STEPS, name
        assert waits["device_syncs"] == {}, f"{name}: device-wide synchronize inside a step: {waits['device_syncs']}"
        if "zero0" in name:
            reads = {}
            for site, n in waits["host_reads"].items():
                reads[site.rsplit(":", 1)[0]] = reads.get(site.rsplit(":", 1)[0], 0) + n
            assert reads == ONE_READ, f"{name}: the host read the device {waits['host_reads']} in {STEPS} steps"
            assert sum(waits["cuda_syncs"].values()) <= STEPS, f"{name}: {waits['cuda_syncs']}"
