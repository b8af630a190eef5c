"""Resumes at another layout: elastic DP (4 -> 2, 2 -> 4, ZeRO 0-3), TP resharding, pipeline and ZeRO-stage
changes through the universal form, and bf16 ZeRO-0 <-> ZeRO-1. A layout change reorders cross-rank sums: losses
and gradient norms continue the uninterrupted run within 1e-4 (tests/distributed/test_resume.py says why both)."""

import pytest

from megatron_lite.checkpoint.store import step_name
from tests.distributed.common import (
    max_abs_diff,
    overrides,
)
from tests.distributed.launcher import run_configs
from tests.distributed.test_resume import STEPS8, assert_continues, assert_each_continues


def resume_at(tmp_path, name: str, layout: list[str], dp_to: int) -> list[str]:
    """Overrides that resume run `name`'s step-4 checkpoint on `dp_to` ranks (into a checkpoint dir of its own)."""
    return overrides(
        tmp_path,
        f"{name}_to{dp_to}",
        *STEPS8,
        *layout,
        f"checkpoint.dir={tmp_path}/{name}_to{dp_to}_ckpt",
        f"checkpoint.resume={tmp_path}/{name}/checkpoints/{step_name(4)}",
    )


def staged_runs(tmp_path):
    """(run, resume): run(name, stage, *extra) trains 8 steps at a ZeRO stage saving at 4; resume(name, source,
    stage, *extra) does so from run `source`'s step 4 (into a checkpoint dir of its own)."""

    def run(name: str, stage: int, *extra: str) -> list[str]:
        return overrides(tmp_path, name, *STEPS8, f"zero.stage={stage}", "checkpoint.interval=4", *extra)

    def resume(name: str, source: str, stage: int, *extra: str) -> list[str]:
        return run(
            name,
            stage,
            *extra,
            f"checkpoint.dir={tmp_path}/{name}_ckpt",
            f"checkpoint.resume={tmp_path}/{source}/checkpoints/{step_name(4)}",
        )

    return run, resume


def test_elastic_dp_resume(tmp_path):
    """Save at one DP size, resume at another: loss and grad norm continue the uninterrupted run within 1e-4.
    The accumulation count changes with the DP size (1 at dp=4, 2 at dp=2): a wrong scale shows in the norms.
    ZeRO-2, 4 -> 2: the cheapest case, in `make test-fast`. ZeRO-1 is not repeated here: its states are ZeRO-2's (one
    optimizer class, one universal conversion), and a ZeRO-1 checkpoint is resumed on another layout in
    test_pipeline_checkpoint and test_context_parallel."""
    (straight,) = run_configs(
        4, [overrides(tmp_path, "z2_4", *STEPS8, "checkpoint.interval=4", "zero.stage=2")], tmp_path
    )
    (resized,) = run_configs(2, [resume_at(tmp_path, "z2_4", ["zero.stage=2"], 2)], tmp_path)
    assert len(resized["losses"]) == 4
    assert_continues(resized, straight, 1e-4, "zero.stage=2: DP 4 -> 2 resume")


@pytest.mark.slow
def test_elastic_dp_resume_zero3_and_growing(tmp_path):
    """As above for ZeRO-3 4 -> 2, and ZeRO-2 and ZeRO-3 2 -> 4: three worlds for the three cases (straight runs at 4;
    straight runs at 2 with the 4 -> 2 resume; the 2 -> 4 resumes), since a world's start-up costs more than a
    tiny run (4 ranks on 2 cores: ~13 s)."""
    layouts = {f"z{stage}": [f"zero.stage={stage}"] for stage in (2, 3)}
    (z3_at4,) = run_configs(
        4, [overrides(tmp_path, "z3_4", *STEPS8, "checkpoint.interval=4", *layouts["z3"])], tmp_path
    )
    z2_at2, z3_at2, z3_4to2 = run_configs(
        2,
        [
            *(
                overrides(tmp_path, f"{name}_2", *STEPS8, "checkpoint.interval=4", *layout)
                for name, layout in layouts.items()
            ),
            resume_at(tmp_path, "z3_4", layouts["z3"], 2),
        ],
        tmp_path,
    )
    z2_2to4, z3_2to4 = run_configs(
        4, [resume_at(tmp_path, f"{name}_2", layout, 4) for name, layout in layouts.items()], tmp_path
    )
    assert_each_continues(
        (
            (z3_4to2, z3_at4, "zero.stage=3: DP 4 -> 2"),
            (z2_2to4, z2_at2, "zero.stage=2: DP 2 -> 4"),
            (z3_2to4, z3_at2, "zero.stage=3: DP 2 -> 4"),
        )
    )


@pytest.mark.parametrize("stage,tp_to,nproc_to", [(1, 1, 2), pytest.param(2, 4, 4, marks=pytest.mark.slow)])
def test_tensor_parallel_resharding_on_resume(stage, tp_to, nproc_to, tmp_path):
    """Save at tp=2 x dp=2, resume at tp=1 x dp=2 or tp=4 x dp=1 (through DeepSpeed's universal format with our
    split patterns): loss and grad norm continue the uninterrupted run within 1e-4."""
    name = f"tp2_z{stage}"
    (straight,) = run_configs(
        4,
        [overrides(tmp_path, name, *STEPS8, "checkpoint.interval=4", "parallel.tp=2", f"zero.stage={stage}")],
        tmp_path,
    )
    (resharded,) = run_configs(
        nproc_to,
        [
            overrides(
                tmp_path,
                f"{name}_to{tp_to}",
                *STEPS8,
                f"zero.stage={stage}",
                f"parallel.tp={tp_to}",
                f"checkpoint.dir={tmp_path}/{name}_to{tp_to}_ckpt",
                f"checkpoint.resume={tmp_path}/{name}/checkpoints/{step_name(4)}",
            )
        ],
        tmp_path,
    )
    assert len(resharded["losses"]) == 4
    assert_continues(resharded, straight, 1e-4, f"zero.stage={stage}: tp 2 -> {tp_to} resume")


def test_zero0_resharding_on_resume(tmp_path):
    """ZeRO-0, the default stage, through the universal form (checkpoint/universal.py): saved at tp=2 x pp=2 and
    resumed at tp=1 x dp=2, at ZeRO-0 and at ZeRO-1; saved at tp=1 x dp=2 by ZeRO-0 and by ZeRO-1 and resumed at
    tp=2 x pp=2 under ZeRO-0 and ZeRO-1, and at tp=2 x dp=2 under ZeRO 1 and 2 (into tp x pp, DeepSpeed's own
    ZeRO 1-2 loader asserts while our model-parallel unit reports a "slice" size of tp x pp).
    Loss and grad norm continue the uninterrupted run within 1e-4. With the moments zeroed on load the losses
    part by 1.8."""
    split = ["parallel.tp=2", "parallel.pp=2"]

    run, resume = staged_runs(tmp_path)

    (z0_split,) = run_configs(4, [run("z0_split", 0, *split)], tmp_path)
    z0_whole, z1_whole, merged, merged_z1 = run_configs(
        2,
        [run("z0_whole", 0), run("z1_whole", 1), resume("merged", "z0_split", 0), resume("merged_z1", "z0_split", 1)],
        tmp_path,
    )
    # Into tp 2 x dp 2 at ZeRO 1 and 2: cut by the split patterns (fused QKV and row-parallel weights cut along
    # dim 0 instead give loss 9.02 at the step after the resume, above the initial 9.01).
    resplit, resplit_z1, z1_tp2, z0_tp2_z2, z1_split = run_configs(
        4,
        [
            resume("resplit", "z0_whole", 0, *split),
            resume("resplit_z1", "z1_whole", 0, *split),
            resume("z1_tp2", "z1_whole", 1, "parallel.tp=2"),
            resume("z0_tp2_z2", "z0_whole", 2, "parallel.tp=2"),
            resume("z1_split", "z1_whole", 1, *split),
        ],
        tmp_path,
    )
    assert_each_continues(
        (
            (merged, z0_split, "tp 2 x pp 2 -> tp 1 x dp 2"),
            (merged_z1, z0_split, "tp 2 x pp 2 -> tp 1 x dp 2 at zero.stage=1"),
            (resplit, z0_whole, "tp 1 x dp 2 -> tp 2 x pp 2"),
            (resplit_z1, z1_whole, "zero.stage=1 at tp 1 x dp 2 -> tp 2 x pp 2"),
            (z1_tp2, z1_whole, "zero.stage=1: tp 1 x dp 2 -> tp 2 x dp 2"),
            (z0_tp2_z2, z0_whole, "tp 1 x dp 2 -> zero.stage=2 at tp 2 x dp 2"),
            (z1_split, z1_whole, "zero.stage=1: tp 1 x dp 2 -> tp 2 x pp 2"),
        ),
        "zero.stage=0: ",
    )


def test_zero3_resharding_on_resume(tmp_path):
    """ZeRO-3 through our universal loaders (engine/repairs/universal_load.py): saved at tp=2 and resumed at tp=1 x dp=2,
    into ZeRO-3 (also with the optimizer offloaded: DeepSpeed's CPU Adam keeps its step as a number), into
    ZeRO-0 (our cut), into ZeRO-2 and into ZeRO-1 with CPU Adam (the ZeRO 1-2 loader, whose optimizer creates
    its states at the first step: the loader makes them, a Python int step for CPU Adam); a ZeRO-1 checkpoint
    at tp=1 x dp=2 resumed at ZeRO-3, tp=2. DeepSpeed's own loaders cannot: its ZeRO-3 loader partitions a full
    TP weight as it is, and its ZeRO 1-2 loader reads model-states files that a ZeRO-3 checkpoint names
    otherwise. Loss and grad norm continue the uninterrupted run within 1e-4."""
    run, resume = staged_runs(tmp_path)

    z3_tp2, z1_dp2 = run_configs(2, [run("z3_tp2", 3, "parallel.tp=2"), run("z1_dp2", 1)], tmp_path)
    merged, merged_cpu, merged_z0, split, to_z2, to_z1_cpu = run_configs(
        2,
        [
            resume("merged", "z3_tp2", 3),
            resume("merged_cpu", "z3_tp2", 3, "zero.offload_optimizer=cpu"),
            resume("merged_z0", "z3_tp2", 0),
            resume("split", "z1_dp2", 3, "parallel.tp=2"),
            resume("to_z2", "z3_tp2", 2),
            resume("to_z1_cpu", "z3_tp2", 1, "zero.offload_optimizer=cpu"),
        ],
        tmp_path,
    )
    assert_each_continues(
        (
            (merged, z3_tp2, "zero.stage=3: tp 2 -> tp 1 x dp 2"),
            (merged_cpu, z3_tp2, "zero.stage=3: tp 2 -> tp 1 x dp 2 with CPU Adam"),
            (merged_z0, z3_tp2, "zero.stage=3 at tp 2 -> zero.stage=0 at tp 1 x dp 2"),
            (split, z1_dp2, "zero.stage=1 at tp 1 x dp 2 -> zero.stage=3 at tp 2"),
            (to_z2, z3_tp2, "zero.stage=3 at tp 2 -> zero.stage=2 at tp 1 x dp 2"),
            (to_z1_cpu, z3_tp2, "zero.stage=3 at tp 2 -> zero.stage=1 with CPU Adam"),
        )
    )


def test_zero0_and_zero1_convert_into_each_other_in_bf16(tmp_path):
    """bf16, where the stages keep different formats (ZeRO-0 fp32 parameters under autocast, ZeRO 1-2 bf16 ones
    beside fp32 masters; every state is a full fp32 tensor in the universal form): ZeRO-0 -> ZeRO-1 and ZeRO-1 ->
    ZeRO-0 at step 4 of 8 follow the straight run of the stage they continue in; so do a change of precision,
    which converts: bf16 ZeRO-1 (DeepSpeed's bf16 optimizer) resumed in fp32 at ZeRO-2, and fp32 ZeRO-2 resumed in
    bf16, each against the straight run it continues.

    Steps 5-7 are compared, within 1e-2. Measured: the four resumed runs differ from their straight runs by at most
    7.0e-4 there (the stages' own straight runs by 8.6e-4); with the loaders broken on purpose, a lost step count
    moves step 6 by 2.1e-2 and step 7 by 1.3, lost moments step 6 by 5.3e-2 and step 7 by 1.5, in all four cases.
    Step 8 is not compared: it follows a jump of the loss (5.29 -> 6.0) at which the two stages' own straight runs
    already part by 4.5e-2 on one machine, and where the resumed ones parted by 5.4e-2 on that machine and by 7.8e-2
    on another with the same torch and DeepSpeed (the bound of 5e-2 on all four steps failed there every time)."""

    def run(name: str, stage: int, *extra: str, precision: str = "bf16") -> list[str]:
        return overrides(
            tmp_path,
            name,
            *STEPS8,
            f"train.precision={precision}",
            f"zero.stage={stage}",
            "checkpoint.interval=4",
            *extra,
        )

    def resume(name: str, stage: int, source: str, precision: str = "bf16") -> list[str]:
        return run(
            name,
            stage,
            f"checkpoint.dir={tmp_path}/{name}_ckpt",
            f"checkpoint.resume={tmp_path}/{source}/checkpoints/{step_name(4)}",
            precision=precision,
        )

    z0, z1, z2_fp32 = run_configs(2, [run("z0", 0), run("z1", 1), run("z2_fp32", 2, precision="fp32")], tmp_path)
    to_z1, to_z0, to_fp32, to_bf16 = run_configs(
        2,
        [
            resume("z0_to_z1", 1, "z0"),
            resume("z1_to_z0", 0, "z1"),
            resume("z1_to_fp32_z2", 2, "z1", "fp32"),
            resume("z2_fp32_to_bf16", 2, "z2_fp32"),
        ],
        tmp_path,
    )
    for resumed, straight, what in (
        (to_z1, z1, "ZeRO-0 -> ZeRO-1"),
        (to_z0, z0, "ZeRO-1 -> ZeRO-0"),
        (to_fp32, z1, "ZeRO-1 -> fp32 ZeRO-2"),
        (to_bf16, z2_fp32, "fp32 ZeRO-2 -> bf16 ZeRO-2"),
    ):
        assert len(resumed["losses"]) == 4, what
        gap = max_abs_diff(resumed["losses"][:3], straight["losses"][4:7])
        assert gap <= 1e-2, f"bf16 {what} at step 4: losses at steps 5-7 differ from the straight run by {gap:.2e}"
