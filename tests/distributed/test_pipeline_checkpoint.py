"""Pipeline checkpoints at another layout: resharding on resume and HF export.

A pipeline checkpoint holds each stage's parameters under their global names; DeepSpeed's universal conversion
unions the stages (and merges TP shards), so a ZeRO-1/2 checkpoint resumes at another pp / vpp / dp and exports
to HF like any other. Resumed runs continue the uninterrupted run's losses and grad norms within 1e-4 (a layout
change reorders cross-rank sums; measured 0.0 on losses, <= 7.1e-8 on norms).
"""

import pytest

from megatron_lite.checkpoint.store import step_name
from tests.distributed.common import assert_same_hf_export, max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs

STEPS8 = ["train.steps=8", "checkpoint.keep=0"]
TOL = 1e-4


def resume_elsewhere(tmp_path, nproc_from: int, layout_from: list[str], nproc_to: int, layout_to: list[str]):
    (straight,) = run_configs(
        nproc_from, [overrides(tmp_path, "straight", *STEPS8, *layout_from, "checkpoint.interval=4")], tmp_path
    )
    (resumed,) = run_configs(
        nproc_to,
        [
            overrides(
                tmp_path,
                "resumed",
                *STEPS8,
                *layout_to,
                f"checkpoint.dir={tmp_path}/resumed_ckpt",
                f"checkpoint.resume={tmp_path}/straight/checkpoints/{step_name(4)}",
            )
        ],
        tmp_path,
    )
    assert len(resumed["losses"]) == 4
    gap = max_abs_diff(resumed["losses"], straight["losses"][4:])
    norms = max_relative_diff(resumed["grad_norms"], straight["grad_norms"][4:])
    assert gap <= TOL and norms <= TOL, f"{layout_from} -> {layout_to}: losses {gap:.2e}, grad norms {norms:.2e}"


def test_pipeline_resharding_pp2_to_pp1(tmp_path):
    """pp=2 (tied embedding on both stages), ZeRO-1, to one process."""
    resume_elsewhere(tmp_path, 2, ["parallel.pp=2", "zero.stage=1"], 1, ["zero.stage=1"])


@pytest.mark.slow
def test_pipeline_resharding_pp2_vpp2_to_pp4(tmp_path):
    """pp=2 x vpp=2 with ZeRO-1 to pp=4 with ZeRO-2 (the stage changes too)."""
    resume_elsewhere(
        tmp_path, 2, ["parallel.pp=2", "parallel.vpp=2", "zero.stage=1"], 4, ["parallel.pp=4", "zero.stage=2"]
    )


def test_hf_export_from_pp2_equals_export_from_pp1(tmp_path):
    """Two steps at pp=1 and at pp=2 (ZeRO-1) from the same seed, exported to HF: every tensor within 1e-4
    (as the TP export test: only the order of additions differs, which Adam can amplify up to lr in
    near-zero gradients). A wrong stage merge would differ by the weights' scale."""
    steps = ["train.steps=2", "zero.stage=1"]
    (pp1,) = run_configs(1, [overrides(tmp_path, "pp1", *steps)], tmp_path)
    (pp2,) = run_configs(2, [overrides(tmp_path, "pp2", *steps, "parallel.pp=2")], tmp_path)
    assert max_relative_diff(pp2["grad_norms"], pp1["grad_norms"]) <= TOL
    assert_same_hf_export(tmp_path, ("pp1", "pp2"), TOL)
