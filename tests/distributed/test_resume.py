"""Checkpoints: exact resume, a killed write is never loaded, HF export and weights-only checkpoints across TP,
offload switched at a resume (resumes at another layout: test_resharding.py).

A resumed run must continue the uninterrupted run's per-step losses *and* gradient norms (relative): a
resumed optimizer or accumulation that scales the gradient wrongly hides from the losses under Adam
(tests/distributed/common.py): scaling the resumed gradient by 2 moved the losses by 4.8e-7 and the
gradient norms by 100%. Exact resumes restore every state in the same layout: 1e-6 on both (measured: 0.0).
A layout change reorders cross-rank sums: 1e-4 on both (measured: losses <= 4.8e-7, norms <= 1.4e-7)."""

import json
import os
import subprocess

import numpy as np
import pytest

from megatron_lite.checkpoint.store import latest_checkpoint, step_name
from tests.distributed.common import (
    TEST_VOCAB,
    assert_same_hf_export,
    async_io_available,
    max_abs_diff,
    max_relative_diff,
    overrides,
    real_corpus_overrides,
    test_corpus,
    write_prepared,
)
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, run_configs, torchrun_cmd

STEPS8 = ["train.steps=8", "checkpoint.keep=0"]


def assert_continues(resumed: dict, straight: dict, tol: float, what: str) -> None:
    """The resumed run's steps equal the straight run's last steps: losses (absolute), grad norms (relative)."""
    n = len(resumed["losses"])
    gap = max_abs_diff(resumed["losses"], straight["losses"][-n:])
    assert gap <= tol, f"{what}: losses differ from the straight run by {gap:.2e}"
    norms = max_relative_diff(resumed["grad_norms"], straight["grad_norms"][-n:])
    assert norms <= tol, f"{what}: grad norms differ from the straight run by {norms:.2e} (relative)"


def assert_each_continues(cases, what_before: str = "") -> None:
    """Each (resumed, straight, what) case ran its 4 resumed steps and continues its straight run within 1e-4."""
    for resumed, straight, what in cases:
        assert len(resumed["losses"]) == 4, what
        assert_continues(resumed, straight, 1e-4, f"{what_before}{what} resume")


def straight_then_resumed(nproc: int, tmp_path, layout: list[str]) -> tuple[dict, dict]:
    """8 straight steps saving at 4, then a fresh `nproc`-rank world resuming from step 4 (same layout)."""
    return straights_then_resumed(nproc, tmp_path, {"straight": layout})["straight"]


def straights_then_resumed(nproc: int, tmp_path, layouts: dict[str, list[str]]) -> dict[str, tuple[dict, dict]]:
    """Per named layout: 8 straight steps saving at 4 (run dir <name>), all in one `nproc`-rank world; then a
    fresh world resumes each from its step 4 (run dir <name>_resumed). Two worlds whatever the number of
    layouts: a world's start-up (torchrun, imports, rendezvous: ~6 s) costs more than a tiny run."""
    straight = run_configs(
        nproc,
        [overrides(tmp_path, name, *STEPS8, *layout, "checkpoint.interval=4") for name, layout in layouts.items()],
        tmp_path,
    )
    resumed = run_configs(
        nproc,
        [
            overrides(
                tmp_path,
                f"{name}_resumed",
                *STEPS8,
                *layout,
                f"checkpoint.dir={tmp_path}/{name}_resumed/checkpoints",
                f"checkpoint.resume={tmp_path}/{name}/checkpoints/{step_name(4)}",
            )
            for name, layout in layouts.items()
        ],
        tmp_path,
    )
    assert all(len(r["losses"]) == 4 for r in resumed), [len(r["losses"]) for r in resumed]
    return dict(zip(layouts, zip(straight, resumed)))


def test_exact_resume_8_equals_4_plus_4(tmp_path):
    """8 straight steps (saving at 4) vs a fresh process resuming from step 4: loss and grad norm <= 1e-6; also
    for a blend of two datasets (data.path a list, data.weights), whose stream the resume must pick up in both."""
    other = (
        np.fromfile(os.path.join(ROOT, "data", "shakespeare-8k", "train.bin"), dtype=np.uint16, count=120_000)[40_000:]
        % TEST_VOCAB
    )  # later text than the folded corpus's
    second = write_prepared(tmp_path / "second", {"train": other[:60_000], "val": other[60_000:]}, TEST_VOCAB)
    blend = [f"data.path=[{test_corpus()[0].split('=', 1)[1]},{second}]", "data.weights=[1,3]"]
    runs = straights_then_resumed(1, tmp_path, {"straight": [], "blend": blend})
    for name, (straight, resumed) in runs.items():
        assert_continues(resumed, straight, 1e-6, f"{name}: resumed steps 5-8")
    assert max_abs_diff(runs["blend"][0]["losses"], runs["straight"][0]["losses"]) > 1e-2  # other samples


def test_exact_resume_with_tensor_parallel_and_dropout(tmp_path):
    """tp=2 x dp=2, ZeRO-2, SP, dropout 0.1: 8 straight steps vs a restart from step 4 in a fresh world,
    <= 1e-6. Exactness needs the same dropout masks after the restart: they are keyed by the step (saved in
    meta.json) with the seed, micro-batch, layer, site and tp rank, so no generator state carries them."""
    layout = ["parallel.tp=2", "parallel.sp=true", "zero.stage=2", "model.dropout=0.1"]
    straight, resumed = straight_then_resumed(4, tmp_path, layout)
    assert_continues(resumed, straight, 1e-6, "tp=2 resume")


def killed_writing_step_4(args: list[str], ckpt: str, step: int = 4, **env: str) -> subprocess.CompletedProcess:
    """Run 2 ranks of fault_worker.py, rank 1 SIGKILLed while it writes step 4's checkpoint (env: more fault
    knobs); the job fails, `latest` stays step 2 (with step=2, the first save: there is none) and step 4 never
    commits. Returns the job."""
    crashed = subprocess.run(
        torchrun_cmd(2, os.path.join(ROOT, "tests/distributed/fault_worker.py"), *args),
        env=rank_env(KILL_RANK="1", KILL_TAG=step_name(step), **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    clean_shared_memory()
    assert crashed.returncode != 0, "the injected SIGKILL did not fail the job"
    assert latest_checkpoint(ckpt) == (os.path.join(ckpt, step_name(step - 2)) if step > 2 else None)
    assert not os.path.exists(os.path.join(ckpt, step_name(step), "meta.json"))
    return crashed


# quick tier; the other layouts of the same feature run in `make test`.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_killed_checkpoint_write_is_never_loaded(stage, tmp_path):
    """Rank 1 dies while writing step 4; the restart must load step 2 and continue the same trajectory."""
    args = real_corpus_overrides(tmp_path, "run", *STEPS8, "checkpoint.interval=2", f"zero.stage={stage}")
    ckpt = f"{tmp_path}/run/checkpoints"
    killed_writing_step_4(args, ckpt)

    resumed, straight = run_configs(
        2,
        [
            args[:-3] + ["checkpoint.resume=auto", "checkpoint.interval=2", f"zero.stage={stage}"],
            real_corpus_overrides(tmp_path, "straight", *STEPS8, f"zero.stage={stage}"),
        ],
        tmp_path,
    )
    with open(f"{tmp_path}/run/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps[-6:] == [3, 4, 5, 6, 7, 8], steps  # the restart continued from step 2
    assert len(resumed["losses"]) == 6
    assert_continues(resumed, straight, 1e-6, f"zero.stage={stage}: restart from step 2")
    assert os.path.isfile(os.path.join(ckpt, step_name(4), "meta.json"))  # rewritten cleanly this time


def test_killed_first_checkpoint_write_starts_fresh(tmp_path):
    """Rank 1 dies while writing the first checkpoint (step 2), leaving a step directory that never committed and no
    `latest`: the restart (resume=auto, as torchrun --max-restarts and a Slurm requeue run it) must start from step
    0, not refuse, and train the uninterrupted trajectory, its own save of step 2 replacing the leftover."""
    args = real_corpus_overrides(tmp_path, "run", *STEPS8, "checkpoint.interval=2", "zero.stage=1")
    ckpt = f"{tmp_path}/run/checkpoints"
    killed_writing_step_4(args, ckpt, step=2)
    restarted, straight = run_configs(
        2,
        [
            args[:-3] + ["checkpoint.resume=auto", "checkpoint.interval=2", "zero.stage=1"],
            real_corpus_overrides(tmp_path, "straight", *STEPS8, "zero.stage=1"),
        ],
        tmp_path,
    )
    assert len(restarted["losses"]) == 8
    assert_continues(restarted, straight, 1e-6, "restart after an interrupted first save")
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, step_name(8))
    assert os.path.isfile(os.path.join(ckpt, step_name(2), "meta.json")) or not os.path.exists(
        os.path.join(ckpt, step_name(2))
    )  # rewritten (or pruned by checkpoint.keep), never the leftover


def test_hf_export_from_tp2_equals_export_from_tp1(tmp_path):
    """Two steps at tp=1 and at tp=2 x dp=2 (ZeRO-1), and at tp=1 and tp=2 x pp=2 (ZeRO-0, whose checkpoint
    keeps no ZeRO optimizer files: checkpoint/universal._zero0_to_universal), from the same seed, then export each
    to HF: every tensor agrees within 1e-4. The runs differ only by the order of cross-rank sums, but Adam's
    normalised update can turn a 1e-7 difference in a near-zero gradient into up to lr (3e-3 here); measured
    max 1.1e-5. A wrong merge (a permuted or misplaced shard) would differ by the weights' scale, ~2e-2. The
    runs' grad norms agree within 1e-4 (relative; measured 2.0e-7)."""
    steps = ["train.steps=2"]
    tp1 = run_configs(
        1,
        [overrides(tmp_path, "tp1_z1", *steps, "zero.stage=1"), overrides(tmp_path, "tp1_z0", *steps, "zero.stage=0")],
        tmp_path,
    )
    tp2 = run_configs(
        4,
        [
            overrides(tmp_path, "tp2_z1", *steps, "zero.stage=1", "parallel.tp=2"),
            overrides(tmp_path, "tp2_z0", *steps, "zero.stage=0", "parallel.tp=2", "parallel.pp=2"),
        ],
        tmp_path,
    )
    for stage, one, two in zip((1, 0), tp1, tp2):
        norms = max_relative_diff(two["grad_norms"], one["grad_norms"])
        assert norms <= 1e-4, f"zero.stage={stage}: tp=2 grad norms differ from tp=1 by {norms:.2e} (relative)"
        assert_same_hf_export(tmp_path, (f"tp1_z{stage}", f"tp2_z{stage}"), 1e-4)


def test_weights_only_checkpoint_trains_at_tp2_with_its_vocabulary_repadded(tmp_path):
    """A weights-only checkpoint (what tools/convert_hf.py import writes) pads the vocabulary for tp 1: 520 tokens
    to 576 rows. At tp 2 the model has 640 (model.vocab_multiple 64 x tp), so the rows are re-padded with zeros as
    the weights are loaded (it refused with "wrong shapes" before). Two steps from it at tp 1 and at tp 2 + SP:
    losses within 1e-5, grad norms within 1e-4 relative (only cross-rank sums differ)."""
    from omegaconf import OmegaConf

    from megatron_lite.checkpoint.weights import save_model_state
    from megatron_lite.cli import compose_config
    from megatron_lite.model.gpt import GPT

    vocab = ["model.vocab_size=520"]
    model_cfg = OmegaConf.to_object(compose_config(overrides(tmp_path, "probe", *vocab))).model
    save_model_state(str(tmp_path / "imported"), model_cfg, GPT(model_cfg, seed=11).materialize().state_dict())
    common = ["train.steps=2", *vocab, f"checkpoint.resume={tmp_path}/imported/{step_name(0)}"]
    one, two = run_configs(
        2,
        [overrides(tmp_path, "tp1", *common), overrides(tmp_path, "tp2", *common, "parallel.tp=2", "parallel.sp=true")],
        tmp_path,
    )
    assert max_abs_diff(two["losses"], one["losses"]) <= 1e-5, (one["losses"], two["losses"])
    assert max_relative_diff(two["grad_norms"], one["grad_norms"]) <= 1e-4, (one["grad_norms"], two["grad_norms"])


def test_cpu_offload_switched_on_at_a_resume(tmp_path):
    """A ZeRO-1 checkpoint written without offload (torch's fused AdamW) resumed with the optimizer on the CPU
    (DeepSpeed's CPU Adam): the loaded groups lacked CPU Adam's bias_correction, a KeyError at the first step,
    until the engine put back every hyperparameter of its own optimizer. The same layout, but CPU Adam's own
    arithmetic from step 5 on: 1e-4 (measured: losses <= 1e-6, norms 5.4e-6)."""
    straight = run_configs(2, [overrides(tmp_path, "z1", *STEPS8, "zero.stage=1", "checkpoint.interval=4")], tmp_path)[
        0
    ]
    (resumed,) = run_configs(
        2,
        [
            overrides(
                tmp_path,
                "z1_cpu",
                *STEPS8,
                "zero.stage=1",
                "zero.offload_optimizer=cpu",
                f"checkpoint.dir={tmp_path}/z1_cpu/checkpoints",
                f"checkpoint.resume={tmp_path}/z1/checkpoints/{step_name(4)}",
            )
        ],
        tmp_path,
    )
    assert len(resumed["losses"]) == 4
    assert_continues(resumed, straight, 1e-4, "ZeRO-1 resumed with CPU offload")


@pytest.mark.slow  # DeepSpeed's async I/O op builds in the background while the other tests run (tests/conftest.py)
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not async_io_available(), reason="NVMe offload needs libaio (make test installs libaio-dev as root)"
)
def test_nvme_offloaded_optimizer_resumes(async_io_op, tmp_path):
    """ZeRO-3 with the optimizer swapped to NVMe (the matrices' sub-group; the vectors' is too small to swap and
    stays in memory), alone and with the parameters on NVMe too (its checkpoints written in the background:
    checkpoint.async_save), on 2 ranks: 8 straight steps vs a restart from
    step 4, exact (1e-6), without a conversion. DeepSpeed 0.19's own load of such a checkpoint (its swap files
    copied back, its optimizer files skipped) resumes 1.1 off in the losses (measured: the in-memory sub-group at
    its initial values, the steps restarted); each rank fills its sub-groups from its own files (engine/repairs/universal_load.load_offloaded). Then another layout and offload both ways at 1 rank,
    1e-4, through the universal form and the swap files the ranks recorded (checkpoint/universal.py): the NVMe
    checkpoint into CPU offload, a CPU-offload checkpoint into NVMe; and the NVMe checkpoint's HF export equals
    the CPU-offload run's (the same arithmetic: 1e-6)."""
    nvme = ["zero.stage=3", "zero.offload_optimizer=nvme"]
    layouts = {
        "nvme": [*nvme, f"zero.nvme_path={tmp_path}/swap_nvme"],
        "nvme_all": [
            *nvme,
            "zero.offload_param=nvme",
            f"zero.nvme_path={tmp_path}/swap_nvme_all",
            "checkpoint.async_save=true",
        ],
        "cpu": ["zero.stage=3", "zero.offload_optimizer=cpu"],
    }
    straight = dict(
        zip(
            layouts,
            run_configs(
                2,
                [
                    overrides(tmp_path, name, *STEPS8, *layout, "checkpoint.interval=4")
                    for name, layout in layouts.items()
                ],
                tmp_path,
            ),
        )
    )

    def resumed(name: str, source: str, *layout: str) -> list[str]:
        return overrides(
            tmp_path,
            name,
            *STEPS8,
            *layout,
            f"checkpoint.dir={tmp_path}/{name}/checkpoints",
            f"checkpoint.resume={tmp_path}/{source}/checkpoints/{step_name(4)}",
        )

    same = run_configs(2, [resumed(f"{name}_resumed", name, *layouts[name]) for name in ("nvme", "nvme_all")], tmp_path)
    for name, result in zip(("nvme", "nvme_all"), same):
        assert len(result["losses"]) == 4, name
        assert_continues(result, straight[name], 1e-6, f"{name} resume")
        assert not os.path.exists(f"{tmp_path}/{name}/checkpoints/{step_name(4)}/universal"), name  # no conversion
    across = run_configs(
        1,
        [
            resumed("nvme_to_cpu", "nvme", "zero.stage=3", "zero.offload_optimizer=cpu"),
            resumed("cpu_to_nvme", "cpu", *nvme, f"zero.nvme_path={tmp_path}/swap_into"),
        ],
        tmp_path,
    )
    assert_each_continues(
        zip(across, (straight["nvme"], straight["cpu"]), ("nvme -> cpu at dp 1", "cpu -> nvme at dp 1"))
    )
    assert_same_hf_export(tmp_path, ("nvme", "cpu"), 1e-6)
