"""Context parallelism (parallel.cp, parallel.cp_mode) against the single process with the same weights.

Model level (tests/distributed/cp_worker.py, 4 gloo ranks): cp in {2, 4} x {ring, ulysses} x {GPT-2 style,
Llama style with GQA}, and tp=2 x cp=2 with sequence parallelism: the loss summed over cp, each rank's logits
and every gradient (summed over cp) equal the serial model's within a relative error of 2e-5 (measured below,
in the worker's output); sequences of 16 and 8 tokens, so chunks of 2 and of 1 token at cp=4 and the causal
boundary inside every diagonal chunk pair (ring blocks by the fused CPU kernel there). Ring attention alone
against masked causal attention, with each block kernel (fused, explicit) and with dropout. With dropout, full
and selective recomputation and a rerun give the same loss and gradients bit for bit.

Training (trajectories over 6 steps, as tests/distributed/test_zero.py): the per-step loss within 1e-4 and the
gradient norm within 1e-4 (relative) of the single process; cross-rank sums only reorder additions.

Checkpoints: an exact resume at the same cp (1e-6) and a resume at another cp through the elastic load (1e-4).
"""

import pytest

from megatron_lite.checkpoint.store import step_name
from tests.distributed import cp_worker
from tests.distributed.common import logged_records, max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs
from tests.distributed.ranks import on_ranks
from tests.distributed.test_resume import STEPS8, assert_continues, straight_then_resumed

TOL = 1e-4


def assert_within(errors: dict[str, float], cases: int) -> None:
    """Every case's largest error within the worker's TOL; bitwise cases exactly equal."""
    print(errors)
    assert len(errors) == cases, errors
    for case, error in errors.items():
        assert error == 0 if "bitwise" in case else error <= cp_worker.TOL, (case, error)


def test_context_parallel_matches_serial_model():
    errors = on_ranks(4, "tests.distributed.cp_worker:errors", "torch", timeout=900)[0]
    # 3 layouts x 2 flavours x 2 modes, the two dropout cases, and at cp 4 and 2 ring attention against masked
    # attention three ways: fused and explicit blocks without dropout, explicit blocks with dropout
    assert_within(errors, 20)
    assert sum("bitwise" in case for case in errors) == 2 and sum("ring attention" in case for case in errors) == 6


@pytest.mark.slow
def test_triton_kernels_under_context_parallel_match_serial():
    """cp=2 with kernels.backend=triton (Triton's interpreter on CPU) against the serial torch model."""
    errors = on_ranks(4, "tests.distributed.cp_worker:errors", "triton", env={"TRITON_INTERPRET": "1"}, timeout=900)[0]
    assert_within(errors, 4)
    assert all("kernels=triton" in case for case in errors), errors


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    (result,) = run_configs(1, [overrides(tmp, "single", "train.eval_interval=3")], tmp)
    return result, tmp


def assert_follows(result: dict, reference: dict, what: str) -> None:
    gap = max_abs_diff(result["losses"], reference["losses"])
    assert gap <= TOL, f"{what}: max |loss - single| = {gap:.2e}"
    norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
    assert norms <= TOL, f"{what}: grad norms differ from the single process by {norms:.2e} (relative)"


# The quick tier keeps cp x dp with ZeRO-2 and full recompute (Ulysses) and cp=4 alone (ring), both with the
# validation loss (the same global batches at every layout); the slow tier adds ring at cp x dp, cp x tp + SP,
# cp inside a pipeline (1F1B, and zbv: the ring's attention holds no weights, its linears defer W), ZeRO-3 (which needs repairs.sum_zero3_gradients_over_cp) and cp=4 Ulysses.
RUNS = {
    "cp2_dp2_zero2_ulysses_full_recompute": (
        ["parallel.cp=2", "parallel.cp_mode=ulysses", "zero.stage=2", "train.recompute=full", "train.eval_interval=3"],
        False,
    ),
    "cp4_ring_zero1": (["parallel.cp=4", "zero.stage=1", "train.eval_interval=3"], False),
    "cp2_dp2_zero2_ring": (["parallel.cp=2", "zero.stage=2"], True),
    "cp2_tp2_sp_zero1": (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "zero.stage=1"], True),
    "cp2_pp2_zero1": (["parallel.cp=2", "parallel.pp=2", "zero.stage=1"], True),
    "cp2_pp2_zbv_zero2": (
        ["parallel.cp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv", "zero.stage=2"],
        True,
    ),
    "cp2_dp2_zero3_selective": (["parallel.cp=2", "zero.stage=3", "train.recompute=selective"], True),
    "cp4_ulysses_zero1": (["parallel.cp=4", "parallel.cp_mode=ulysses", "zero.stage=1"], True),
}


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["quick", "slow"])
def test_context_parallel_training_follows_single_process(slow, reference, tmp_path):
    single, single_tmp = reference
    names = [name for name, (_, is_slow) in RUNS.items() if is_slow == slow]
    results = run_configs(4, [overrides(tmp_path, name, *RUNS[name][0]) for name in names], tmp_path)
    for name, result in zip(names, results):
        assert_follows(result, single, name)
    if not slow:  # validation loss: each cp rank's share summed over cp, then the mean over dp
        want = [r["val_loss"] for r in logged_records(f"{single_tmp}/single") if "val_loss" in r]
        for name in ("cp4_ring_zero1", "cp2_dp2_zero2_ulysses_full_recompute"):
            got = [r["val_loss"] for r in logged_records(f"{tmp_path}/{name}") if "val_loss" in r]
            assert len(got) == 2 and max_abs_diff(got, want) <= TOL, (name, got, want)


def test_exact_resume_at_the_same_context_parallel_layout(tmp_path):
    """cp=2 ring with dropout 0.1, ZeRO-1: 8 straight steps vs a restart from step 4 in a fresh world, <= 1e-6
    (every mask is keyed by the step, the cp rank or the chunk pair: nothing else to restore)."""
    layout = ["parallel.cp=2", "zero.stage=1", "model.dropout=0.1"]
    straight, resumed = straight_then_resumed(2, tmp_path, layout)
    assert_continues(resumed, straight, 1e-6, "cp=2 resume")


@pytest.mark.parametrize(
    "stage,to",
    [(1, ["parallel.cp=1"]), pytest.param(2, ["parallel.cp=1"], marks=pytest.mark.slow)],
    ids=["zero1-cp2-to-cp1", "zero2-cp2-to-cp1"],
)
def test_resume_at_another_context_parallel_size(stage, to, tmp_path):
    """Save at cp=2 (2 ranks), resume at cp=1 on one rank: the ZeRO partitions go from dp x cp = 2 to 1, so the
    checkpoint passes through the universal format; the parameters, replicated over cp, load whole. Loss and
    grad norm continue the uninterrupted run within 1e-4."""
    (straight,) = run_configs(
        2,
        [overrides(tmp_path, "cp2", *STEPS8, "checkpoint.interval=4", "parallel.cp=2", f"zero.stage={stage}")],
        tmp_path,
    )
    (resized,) = run_configs(
        1,
        [
            overrides(
                tmp_path,
                "cp1",
                *STEPS8,
                *to,
                f"zero.stage={stage}",
                f"checkpoint.dir={tmp_path}/cp1_ckpt",
                f"checkpoint.resume={tmp_path}/cp2/checkpoints/{step_name(4)}",
            )
        ],
        tmp_path,
    )
    assert len(resized["losses"]) == 4
    assert_continues(resized, straight, 1e-4, f"zero.stage={stage}: cp 2 -> 1 resume")
