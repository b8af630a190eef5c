"""ZeRO 0/1/2/3 (and CPU optimizer offload) on 2 and 4 gloo ranks follow the single-process trajectory.

The global batch is the same in every run (8 sequences); only how it is split over ranks and accumulation
steps changes. Tolerance: 1e-4 absolute on the per-step loss over 6 steps in fp32. Cross-rank sums
reorder floating-point additions, so runs are not bitwise equal; the measured gap is ~1e-6.
"""

import pytest

from tests.distributed.common import max_abs_diff, overrides
from tests.distributed.launcher import run_configs

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    (result,) = run_configs(1, [overrides(tmp, "single")], tmp)
    assert len(result["losses"]) == 6
    return result["losses"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_zero_stages_match_single_process(nproc, reference, tmp_path):
    runs = [overrides(tmp_path, f"zero{stage}", f"zero.stage={stage}") for stage in (0, 1, 2, 3)]
    results = run_configs(nproc, runs, tmp_path)
    for stage, result in zip((0, 1, 2, 3), results):
        gap = max_abs_diff(result["losses"], reference)
        assert gap <= TOL, f"zero.stage={stage} on {nproc} ranks: max |loss - single| = {gap:.2e}"


def test_cpu_optimizer_offload_matches_no_offload(reference, tmp_path):
    runs = [overrides(tmp_path, "offload2", "zero.stage=2", "zero.offload_optimizer=cpu"),
            overrides(tmp_path, "offload3", "zero.stage=3", "zero.offload_optimizer=cpu")]
    for result in run_configs(2, runs, tmp_path):
        gap = max_abs_diff(result["losses"], reference)
        assert gap <= TOL, f"{result['overrides'][-2:]}: max |loss - single| = {gap:.2e}"
