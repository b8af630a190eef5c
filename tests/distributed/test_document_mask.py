"""data.document_mask on every layout against the single process with the same weights and data.

The data: the folded test corpus cut into documents of 1-119 tokens (about three to a 128-token window) with
their index (common.documents_corpus). Each layout's per-step loss within 1e-4 and gradient norm within 1e-4
(relative) of the single process over 6 steps, as the other trajectory tests (the Llama-style runs' gradient norms
within 5e-4: see LLAMA_NORM_TOL): with the mask each micro-batch's
loss is summed over the labels it predicts and divided by the global batch's count per micro-batch, so the
layouts differ only in the order of additions. The loss counts only labels that do not begin a document, and
the same windows without the mask give other losses (the mask is on).

Resume: 8 steps straight against a restart from step 4 at the same layout (1e-6: the windows and their documents
are a function of the step) and at another layout through the universal checkpoint (1e-4).
"""

import pytest

from megatron_lite.checkpoint.store import step_name
from tests.distributed.common import documents_corpus, max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs
from tests.distributed.test_context_parallel import TOL, assert_follows
from tests.distributed.test_resume import STEPS8, assert_continues, straight_then_resumed

LLAMA = ["model=llama-tiny"]
# Step 4 of the Llama-style run is ill-conditioned: the single process alone moves its gradient norm by 7.6e-5
# (relative) when only its micro-batch size changes (1 instead of 2; every other step by at most 1.2e-6, and the
# loss by 2e-6), so a layout that reorders more sums moves it more (cp 2 ring + tp 2 + SP: 1.9e-4; losses 4e-6).
LLAMA_NORM_TOL = 5e-4
# (overrides, flavour, slow): 4 ranks each
RUNS = {
    "tp2_sp_dp2_zero1": (["parallel.tp=2", "parallel.sp=true", "zero.stage=1"], [], False),
    "pp2_interleaved_dp2_zero1": (
        ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "zero.stage=1"],
        [],
        False,
    ),
    "cp2_ring_dp2_zero3": (["parallel.cp=2", "parallel.cp_mode=ring", "zero.stage=3"], [], False),
    "cp2_ulysses_tp2_zero1": (
        ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.tp=2", "zero.stage=1"],
        [],
        False,
    ),
    "pp2_1f1b_dp2_zero2_full_recompute": (
        ["parallel.pp=2", "parallel.schedule=1f1b", "zero.stage=2", "train.recompute=full"],
        [],
        True,
    ),
    "dp4_zero3_selective": (["zero.stage=3", "train.recompute=selective"], [], True),
    "cp4_ring_zero1": (["parallel.cp=4", "zero.stage=1"], [], True),
    "llama_cp2_ring_tp2_sp": (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "zero.stage=1"], LLAMA, True),
    "llama_pp2_interleaved_dp2_zero2": (
        ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "zero.stage=2"],
        LLAMA,
        True,
    ),
}


def _documents(tmp_path, name: str, *extra: str) -> list[str]:
    return [*overrides(tmp_path, name, *extra), *documents_corpus()]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single process with the mask (both flavours) and, for the GPT-2 flavour, without it."""
    tmp = tmp_path_factory.mktemp("ref")
    gpt2, llama, unmasked = run_configs(
        1,
        [
            _documents(tmp, "single"),
            _documents(tmp, "single_llama", *LLAMA),
            [*_documents(tmp, "single_unmasked"), "data.document_mask=false"],
        ],
        tmp,
    )
    return {"gpt2": gpt2, "llama": llama, "unmasked": unmasked}


def test_the_mask_changes_the_losses(references):
    """Measured 6.1e-3 over these 6 steps (near initialisation attention is spread thin, so masking part of it
    moves the loss little): 60x the tolerance the layouts are held to."""
    gap = max_abs_diff(references["gpt2"]["losses"], references["unmasked"]["losses"])
    assert gap > 10 * TOL, f"the mask changed the losses by only {gap:.2e}"


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["quick", "slow"])
def test_document_mask_follows_single_process(slow, references, tmp_path):
    names = [name for name, (_, _, is_slow) in RUNS.items() if is_slow == slow]
    runs = [_documents(tmp_path, name, *RUNS[name][1], *RUNS[name][0]) for name in names]
    for name, result in zip(names, run_configs(4, runs, tmp_path)):
        if RUNS[name][1]:  # Llama-style
            reference = references["llama"]
            assert max_abs_diff(result["losses"], reference["losses"]) <= TOL, name
            norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
            assert norms <= LLAMA_NORM_TOL, f"{name}: grad norms differ from the single process by {norms:.2e}"
        else:
            assert_follows(result, references["gpt2"], name)


def test_exact_resume_with_document_mask(tmp_path):
    """cp=2 ring with dropout 0.1: 8 straight steps vs a restart from step 4 in a fresh world, <= 1e-6."""
    layout = ["parallel.cp=2", "zero.stage=1", "model.dropout=0.1", *documents_corpus()]
    straight, resumed = straight_then_resumed(2, tmp_path, layout)
    assert_continues(resumed, straight, 1e-6, "cp=2 resume with document_mask")


@pytest.mark.slow
def test_resume_with_document_mask_at_another_layout(tmp_path):
    """Saved at tp=2 with ZeRO-2, resumed on one rank through the universal checkpoint: within 1e-4."""
    (straight,) = run_configs(
        2, [_documents(tmp_path, "tp2", *STEPS8, "checkpoint.interval=4", "parallel.tp=2", "zero.stage=2")], tmp_path
    )
    resume = f"checkpoint.resume={tmp_path}/tp2/checkpoints/{step_name(4)}"
    (resized,) = run_configs(
        1,
        [_documents(tmp_path, "tp1", *STEPS8, "zero.stage=2", f"checkpoint.dir={tmp_path}/tp1_ckpt", resume)],
        tmp_path,
    )
    assert len(resized["losses"]) == 4
    assert_continues(resized, straight, 1e-4, "tp 2 -> 1 resume with document_mask")
