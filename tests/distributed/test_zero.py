"""ZeRO 0/1/2/3 (and optimizer and parameter offload) on 2 and 4 gloo ranks follow the single-process trajectory.

The global batch is the same in every run (8 sequences); only how it is split over ranks and accumulation
steps changes. Tolerance over 6 steps in fp32: 1e-4 absolute on the per-step loss, 1e-4 relative on the
per-step gradient norm (which must count every parameter once, whatever the layout). Cross-rank sums reorder
floating-point additions, so runs are not bitwise equal; measured: losses <= 3.8e-6, gradient norms
<= 1.4e-6 (ZeRO-0: 4.8e-7 and 2.0e-8).
"""

import glob
import os

import pytest

from tests.distributed.common import async_io_available, max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs

TOL = 1e-4


def assert_follows(result, reference, what: str) -> None:
    gap = max_abs_diff(result["losses"], reference["losses"])
    assert gap <= TOL, f"{what}: max |loss - single| = {gap:.2e}"
    norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
    assert norms <= TOL, f"{what}: grad norms differ from the single process by {norms:.2e} (relative)"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    (result,) = run_configs(1, [overrides(tmp, "single")], tmp)
    assert len(result["losses"]) == 6
    return result


# `slow` (make test-fast skips it): the quick tier keeps one case per feature: every stage on 2 ranks, CPU
# offload of optimizer and parameters together; TP x ZeRO is in the quick tier through test_resharding.py and
# test_kernels_training.py.
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_stages_match_single_process(nproc, reference, tmp_path):
    runs = [overrides(tmp_path, f"zero{stage}", f"zero.stage={stage}") for stage in (0, 1, 2, 3)]
    results = run_configs(nproc, runs, tmp_path)
    for stage, result in zip((0, 1, 2, 3), results):
        assert_follows(result, reference, f"zero.stage={stage} on {nproc} ranks")


OFFLOAD = {"z2-optimizer": (2, []), "z3-optimizer": (3, []), "z3-optimizer-params": (3, ["zero.offload_param=cpu"])}


MORE = pytest.param(["z2-optimizer", "z3-optimizer"], marks=pytest.mark.slow)


@pytest.mark.parametrize("names", [["z3-optimizer-params"], MORE], ids=["quick", "more"])
def test_cpu_offload_matches_no_offload(names, reference, tmp_path):
    """Optimizer states on the CPU (stages 2 and 3), and at stage 3 the parameters too; one world per tier."""
    runs = [
        overrides(tmp_path, name, f"zero.stage={OFFLOAD[name][0]}", "zero.offload_optimizer=cpu", *OFFLOAD[name][1])
        for name in names
    ]
    for name, result in zip(names, run_configs(2, runs, tmp_path)):
        assert_follows(result, reference, f"CPU offload {name}")


@pytest.mark.slow
def test_tensor_parallel_with_zero_matches_single_process(reference, tmp_path):
    """tp=2 x dp=2 on 4 ranks, ZeRO 1/2/3 (plus sequence parallel at stage 3) vs one process, 6 steps."""
    runs = [overrides(tmp_path, f"tp2_zero{stage}", f"zero.stage={stage}", "parallel.tp=2") for stage in (1, 2, 3)]
    runs.append(overrides(tmp_path, "tp2_sp_zero3", "zero.stage=3", "parallel.tp=2", "parallel.sp=true"))
    for result in run_configs(4, runs, tmp_path):
        assert_follows(result, reference, " ".join(result["overrides"][-2:]))


@pytest.mark.slow  # its op builds in the background while the other tests run (tests/conftest.py)
@pytest.mark.timeout(1500)  # the wait for that build (conftest.BUILD_WAIT_S), then the test
@pytest.mark.skipif(
    not async_io_available(), reason="NVMe offload needs libaio (make test installs libaio-dev as root)"
)
def test_nvme_offload_matches_no_offload(async_io_op, reference, tmp_path):
    """Optimizer states on NVMe, and optimizer states plus parameters on NVMe (ZeRO-3 both: DeepSpeed's ZeRO-1/2
    take an NVMe optimizer as CPU offload, which validation refuses), through DeepSpeed's async I/O on a local
    directory. The checkpoint's copies of the swap files show the optimizer states went there; each run swaps
    in a folder of its own under zero.nvme_path (engine/ds_config.swap_dir: two runs at once on one path swapped
    each other's states, 2.7 off in the losses), removed when it ends. Needed a repair
    (repairs.honour_explicit_zero3_dtype): without it the swapped embedding came back rounded to bf16 and the
    losses drifted by 2.3e-4."""
    kinds = {"opt": ["zero.offload_param=none"], "all": ["zero.offload_param=nvme"]}
    runs = [
        overrides(
            tmp_path,
            f"nvme_{kind}",
            "zero.stage=3",
            "zero.offload_optimizer=nvme",
            *extra,
            f"zero.nvme_path={tmp_path}/nvme",
            "checkpoint.interval=6",
        )
        for kind, extra in kinds.items()
    ]
    for kind, result in zip(kinds, run_configs(2, runs, tmp_path)):
        assert_follows(result, reference, f"ZeRO-3 NVMe offload ({kind})")
        assert glob.glob(f"{tmp_path}/nvme_{kind}/checkpoints/*/offloaded_tensors/rank*/*.swp"), kind
    assert not [files for _, _, files in os.walk(f"{tmp_path}/nvme") if files]  # every run's swap files removed
    assert os.listdir(f"{tmp_path}/nvme") == []  # and its folder, not the user's nvme_path


def test_a_zero3_run_leaves_the_next_run_in_its_world_unchanged(tmp_path, monkeypatch):
    """deepspeed.zero.Init(module=...) swaps torch's F.linear for ZeRO-3's memory-efficient linear for the rest of
    the process, and our linears call F.linear; a run puts it back when it ends
    (engine/repairs.restore_functional_linear). A world trains its configurations one after another (and the test
    pool's worlds, tests/distributed/pool.py, spec after spec), so a ZeRO-1 run after a ZeRO-3 one equals the same
    run in a fresh world of its own, bit for bit (without the restore its losses moved in the 7th digit). Every
    run of a test world also checks that nothing of it is left (worker.check_nothing_left)."""
    layout = ["zero.stage=1", "model.dropout=0.1", "train.steps=4"]
    _, after = run_configs(
        2,
        [
            overrides(tmp_path, "z3", "model=llama-tiny", "zero.stage=3", "train.steps=2"),
            overrides(tmp_path, "after_z3", *layout),
        ],
        tmp_path,
    )
    monkeypatch.setenv("MEGATRON_LITE_TEST_POOL", "0")
    (alone,) = run_configs(2, [overrides(tmp_path, "alone", *layout)], tmp_path)
    assert after["losses"] == alone["losses"] and after["grad_norms"] == alone["grad_norms"], (after, alone)


# Parameters past ZeRO-3's 1e5-element persistence threshold (the tiny model's all stay whole on every rank), so
# they are gathered for each use, and hpZ's secondary shards are what the backward gathers.
WIDER = ["model.d_model=256"]


def test_hpz_matches_single_process(tmp_path):
    """ZeRO++ hpZ (zero.hpz=2) on 4 ranks against one process, 6 steps, this module's tolerances: dp 4 in groups
    of 2, and tp 2 x dp 2, where DeepSpeed's own groups (consecutive world ranks) would pair the two TP ranks of
    one dp rank, which hold different shards (engine/repairs.use_hpz_group); plain ZeRO-3 beside them. Then
    resumes: the hpZ run's step-4 checkpoint at its own layout (exact, 1e-6) and on 2 ranks with hpZ through the
    universal form (our loader, which makes the secondary shards again from the loaded masters: 1e-4)."""
    from megatron_lite.checkpoint.store import step_name
    from tests.distributed.test_resume import STEPS8, assert_continues

    (single,) = run_configs(1, [overrides(tmp_path, "single", *WIDER)], tmp_path)
    z3 = ["zero.stage=3", *WIDER]
    hpz = [*z3, "zero.hpz=2"]
    runs = [
        overrides(tmp_path, "z3", *z3),
        overrides(tmp_path, "hpz", *hpz),
        overrides(tmp_path, "tp2_hpz", *hpz, "parallel.tp=2"),
        overrides(tmp_path, "hpz8", *hpz, *STEPS8, "checkpoint.interval=4"),
    ]
    *six, straight = run_configs(4, runs, tmp_path)
    for result in six:
        assert_follows(result, single, " ".join(result["overrides"][-3:]))

    def resumed(name: str) -> list[str]:
        checkpoint = f"checkpoint.resume={tmp_path}/hpz8/checkpoints/{step_name(4)}"
        return overrides(tmp_path, name, *hpz, *STEPS8, f"checkpoint.dir={tmp_path}/{name}_ckpt", checkpoint)

    (same,) = run_configs(4, [resumed("hpz8_same")], tmp_path)
    assert_continues(same, straight, 1e-6, "hpZ resume at its layout")
    (fewer,) = run_configs(2, [resumed("hpz8_dp2")], tmp_path)
    assert_continues(fewer, straight, 1e-4, "hpZ resume dp 4 -> 2")
