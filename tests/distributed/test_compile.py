"""train.compile=true (torch.compile of each block) follows the eager single process: tp=2 with SP, full
recomputation and ZeRO-1, dp=2 with ZeRO-2, and the zero-bubble zbv at pp=2 with ZeRO-2 (its linears and
embeddings defer weight gradients outside the compiled graphs, parallel/weight_grad.py), 6 steps, losses (absolute) and grad norms (relative) within
1e-4 as every layout test (tests/distributed/common.py). Inductor fuses and reorders fp32 arithmetic:
measured per-gradient relative differences <= 3.2e-7 on one step of the tiny models. `slow`: each rank
compiles its blocks first (~40 s on 2 cores)."""

import pytest

from tests.distributed.common import max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs

TOL = 1e-4


@pytest.mark.slow
def test_compiled_blocks_follow_the_eager_single_process(tmp_path):
    (reference,) = run_configs(1, [overrides(tmp_path, "eager")], tmp_path)
    runs = [
        overrides(
            tmp_path,
            "tp2_sp_full_z1",
            "train.compile=true",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.recompute=full",
            "zero.stage=1",
        ),
        overrides(tmp_path, "dp2_z2", "train.compile=true", "zero.stage=2"),
        overrides(
            tmp_path,
            "pp2_zbv_z2",
            "train.compile=true",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=zbv",
            "zero.stage=2",
        ),
    ]
    for result in run_configs(2, runs, tmp_path, timeout=1200):
        what = result["overrides"][-4:]
        gap = max_abs_diff(result["losses"], reference["losses"])
        assert gap <= TOL, f"{what}: max |loss - eager| = {gap:.2e}"
        norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
        assert norms <= TOL, f"{what}: grad norms differ from eager by {norms:.2e} (relative)"
