"""Pipeline parallelism against the single process.

1. Gradients (no DeepSpeed): pp in {2, 4} x vpp in {1, 2} x every schedule (and m not a multiple of pp for
   the interleaved one; m in {pp, 2pp, 3pp+1} for zb_h1, also bitwise against 1F1B) x {GPT-2 style tied,
   Llama style untied}: loss and every gradient within 1e-6 relative (why, and what was measured:
   tests/distributed/pipeline_worker.py).
2. Training (DeepSpeed, gloo): 6-step trajectories, losses (absolute) and grad norms (relative) within 1e-4
   of the single process, as every layout test here (tests/distributed/common.py): pp=2 with ZeRO 0, 1, 2
   and CPU optimizer offload, with vpp=2, with full and selective recomputation; pp=4; and full 3D
   (tp=2 x pp=2 x vpp=2 x dp=2 with SP) on 8 ranks. Validation loss runs through the pipeline too.
   Measured: pp=2 ZeRO 0/1/2 match to <= 5e-7 (loss) and <= 5e-7 (norm, relative).
3. Exact resume at pp=2 x vpp=2: 4 steps + restart + 4 steps equal 8 straight steps (1e-6).
"""

import json
import os

import pytest

from megatron_lite.checkpoint.store import step_name
from tests.distributed import pipeline_worker
from tests.distributed.common import max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import override_value, run_configs
from tests.distributed.ranks import on_ranks

TOL = 1e-4
EVAL = ["train.eval_interval=3", "train.eval_iters=3"]


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def val_losses(run_dir: str) -> list[float]:
    return [r["val_loss"] for r in records(run_dir) if "val_loss" in r]


def assert_follows(result: dict, reference: dict, tol: float = TOL) -> None:
    """Losses, grad norms and validation losses follow `reference` (validation covers the same eval_iters
    global batches at every layout)."""
    what = " ".join(o for o in result["overrides"] if o.startswith(("parallel", "zero", "train.recompute", "model=")))
    gap = max_abs_diff(result["losses"], reference["losses"])
    assert gap <= tol, f"{what}: max |loss - single| = {gap:.2e}"
    norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
    assert norms <= tol, f"{what}: grad norms differ from the single process by {norms:.2e} (relative)"
    run_dir = override_value(result["overrides"], "run.dir")
    ref_dir = override_value(reference["overrides"], "run.dir")
    bubbles = [r.get("bubble") for r in records(run_dir)]
    assert all(b is not None and 0.0 < b < 1.0 for b in bubbles), (what, bubbles)  # logged on every step
    got, want = val_losses(run_dir), val_losses(ref_dir)
    assert len(got) == len(want) == 2 and max_abs_diff(got, want) <= tol, (what, got, want)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    runs = [overrides(tmp, "single", *EVAL), overrides(tmp, "single_llama", "model=llama-tiny", *EVAL)]
    tiny, llama = run_configs(1, runs, tmp)
    return {"tiny": tiny, "llama-tiny": llama}


def test_pipeline_gradients_match_serial():
    """Bounds and the reasons for them: tests/distributed/pipeline_worker.py."""
    results = on_ranks(4, "tests.distributed.pipeline_worker:results")[0]
    for r in results:
        print(r)
    assert len(results) == len({r["case"] for r in results}) == 48
    for r in results:
        assert r["gradients"] <= pipeline_worker.TOL and r["loss"] <= pipeline_worker.TOL, r
        assert r["vs_1f1b"] in (None, 0.0), r  # zb_h1's gradients are 1F1B's, bit for bit
        assert r["kept"] < 2, r  # sent activations gave up their storage
        # a tied pipeline holds wte on its first and last stage; in a V both ends are rank 0's one weight
        assert r["held"] == r["serial"] + (r["case"].startswith("gpt2-tied") and "zbv" not in r["case"]), r


def test_pipeline_zero_stages_match_single_process(references, tmp_path):
    """pp=2 (tied GPT-2 style) with ZeRO 0, 1, 2; pp=2 x vpp=2 with ZeRO-2 + CPU optimizer offload (chunks whose
    first backward is not the step's first, repairs.zero_offload_accumulators); pp=2 x vpp=2 untied."""
    runs = [overrides(tmp_path, f"pp2_z{stage}", "parallel.pp=2", f"zero.stage={stage}", *EVAL) for stage in (0, 1, 2)]
    runs.append(
        overrides(
            tmp_path,
            "pp2_vpp2_z2_offload",
            "parallel.pp=2",
            "parallel.vpp=2",
            "zero.stage=2",
            "zero.offload_optimizer=cpu",
            *EVAL,
        )
    )
    runs.append(
        overrides(
            tmp_path, "pp2_vpp2_llama", "model=llama-tiny", "parallel.pp=2", "parallel.vpp=2", "zero.stage=1", *EVAL
        )
    )
    for result in run_configs(2, runs, tmp_path):
        assert_follows(result, references["llama-tiny" if "model=llama-tiny" in result["overrides"] else "tiny"])


def test_zero_bubble_zero_stages_match_single_process(references, tmp_path):
    """Zero-bubble schedules at pp=2 (weight gradients deferred to W, parallel/weight_grad.py), every ZeRO stage
    a pipeline takes: zb_h1 with ZeRO 0 and 2 (the tied GPT-2 style model: the embedding's W feeds the tied fp32
    accumulator), zbv (vpp=2 in a V: embedding and head on rank 0) with ZeRO-1, and with the untied Llama style,
    ZeRO-2 and CPU optimizer offload: DeepSpeed's gradient hooks run in W, once per parameter and micro-batch."""
    zb_h1, zbv = (
        ["parallel.pp=2", "parallel.schedule=zb_h1", *EVAL],
        ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv", *EVAL],
    )
    runs = [overrides(tmp_path, f"zb_h1_z{stage}", *zb_h1, f"zero.stage={stage}") for stage in (0, 2)]
    runs.append(overrides(tmp_path, "zbv_z1", *zbv, "zero.stage=1"))
    runs.append(
        overrides(tmp_path, "zbv_llama_offload", "model=llama-tiny", *zbv, "zero.stage=2", "zero.offload_optimizer=cpu")
    )
    for result in run_configs(2, runs, tmp_path):
        assert_follows(result, references["llama-tiny" if "model=llama-tiny" in result["overrides"] else "tiny"])


@pytest.mark.slow
def test_pipeline_with_recompute_matches_single_process(references, tmp_path):
    """Recomputation inside chunks (global layer indices): pp=2 x vpp=2, ZeRO-2, full and selective; zb_h1 with
    selective (recomputed attention cores hold no weights, so every linear still defers its W)."""
    runs = [
        overrides(
            tmp_path, f"pp2_{mode}", "parallel.pp=2", "parallel.vpp=2", "zero.stage=2", f"train.recompute={mode}", *EVAL
        )
        for mode in ("full", "selective")
    ]
    runs.append(
        overrides(
            tmp_path,
            "zb_selective",
            "parallel.pp=2",
            "parallel.schedule=zb_h1",
            "zero.stage=2",
            "train.recompute=selective",
            *EVAL,
        )
    )
    for result in run_configs(2, runs, tmp_path):
        assert_follows(result, references["tiny"])


@pytest.mark.slow
def test_pipeline_pp4_matches_single_process(references, tmp_path):
    runs = [
        overrides(tmp_path, "pp4_llama", "model=llama-tiny", "parallel.pp=4", "zero.stage=1", *EVAL),
        overrides(tmp_path, "pp4_gpipe", "parallel.pp=4", "parallel.schedule=gpipe", "zero.stage=2", *EVAL),
    ]
    for result in run_configs(4, runs, tmp_path):
        assert_follows(result, references["llama-tiny" if "model=llama-tiny" in result["overrides"] else "tiny"])


@pytest.mark.slow
def test_full_3d_matches_single_process(references, tmp_path):
    """tp=2 x pp=2 (vpp=2) x dp=2 with sequence parallelism on 8 ranks, ZeRO 1 and 2; and zb_h1 at vpp=1 with
    ZeRO-2 (W gathers the sequence-parallel inputs of the column-parallel linears, sums norm gains over TP)."""
    layout = ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.vpp=2"]
    runs = [overrides(tmp_path, f"3d_z{stage}", *layout, f"zero.stage={stage}", *EVAL) for stage in (1, 2)]
    runs.append(
        overrides(
            tmp_path,
            "3d_zb_z2",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.pp=2",
            "parallel.schedule=zb_h1",
            "zero.stage=2",
            *EVAL,
        )
    )
    for result in run_configs(8, runs, tmp_path, timeout=1500):
        assert_follows(result, references["tiny"])


def test_pipeline_exact_resume(tmp_path):
    """pp=2 x vpp=2, ZeRO-1: 8 straight steps (saving at 4) vs a fresh world resuming at 4: <= 1e-6. The same
    checkpoint resumed by zbv, whose V holds other stages on each rank (stages r and 3-r, not r and 2+r): the
    universal conversion, 1e-4 as every conversion test."""
    layout = ["parallel.pp=2", "parallel.vpp=2", "zero.stage=1", "train.steps=8", "checkpoint.keep=0"]
    (straight,) = run_configs(2, [overrides(tmp_path, "straight", *layout, "checkpoint.interval=4")], tmp_path)
    resume = f"checkpoint.resume={tmp_path}/straight/checkpoints/{step_name(4)}"
    resumed, zbv = run_configs(
        2,
        [
            overrides(tmp_path, "resumed", *layout, f"checkpoint.dir={tmp_path}/resumed_ckpt", resume),
            overrides(
                tmp_path, "resumed_zbv", *layout, "parallel.schedule=zbv", f"checkpoint.dir={tmp_path}/zbv_ckpt", resume
            ),
        ],
        tmp_path,
    )
    assert len(resumed["losses"]) == len(zbv["losses"]) == 4
    assert max_abs_diff(resumed["losses"], straight["losses"][-4:]) <= 1e-6
    assert max_relative_diff(resumed["grad_norms"], straight["grad_norms"][-4:]) <= 1e-6
    assert max_abs_diff(zbv["losses"], straight["losses"][-4:]) <= TOL
    assert max_relative_diff(zbv["grad_norms"], straight["grad_norms"][-4:]) <= TOL
    with open(os.path.join(tmp_path, "straight", "checkpoints", step_name(4), "meta.json")) as f:
        layout_saved = json.load(f)["layout"]
    assert (layout_saved["pp"], layout_saved["vpp"], layout_saved["layers_per_stage"]) == (2, 2, [1, 1, 1, 1])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_kernels_inside_pipeline_chunks(tmp_path):
    """pp=2 x vpp=2 with kernels.backend=triton (norms, RoPE, SwiGLU and the fused cross entropy on the last
    virtual stage) and selective recomputation against torch kernels at dp=2; same global batch, 1e-4."""
    common = ["train.steps=3", "model=llama-tiny", "zero.stage=1"]
    torch_run, triton_run = run_configs(
        2,
        [
            overrides(tmp_path, "dp2_torch", *common, "kernels.backend=torch"),
            overrides(
                tmp_path,
                "pp2_triton",
                *common,
                "kernels.backend=triton",
                "parallel.pp=2",
                "parallel.vpp=2",
                "train.recompute=selective",
            ),
        ],
        tmp_path,
    )
    assert max_abs_diff(triton_run["losses"], torch_run["losses"]) <= TOL
    assert max_relative_diff(triton_run["grad_norms"], torch_run["grad_norms"]) <= TOL


@pytest.mark.slow
def test_pipeline_with_dropout_matches_single_process(tmp_path):
    """Dropout 0.1: every mask is keyed by (seed, step, micro-batch in the global batch, layer, site), never by
    the order of execution (parallel/random.py), so pp=2 with full recomputation and ZeRO-2, and interleaved
    pp=2 x vpp=2, follow the single process with dropout. dp=2 (no pipeline) too: micro-batch j of DP rank r is
    j*dp + r of the global batch, as the sampler orders them. Validation runs in eval mode (no dropout)."""
    dropout = ["model.dropout=0.1", *EVAL]
    single, no_dropout = run_configs(
        1, [overrides(tmp_path, "single_dropout", *dropout), overrides(tmp_path, "single_no_dropout", *EVAL)], tmp_path
    )
    # Dropout must move the trajectory, or matching it below would prove nothing about the masks.
    assert max_abs_diff(single["losses"], no_dropout["losses"]) > 1e-3
    runs = [
        overrides(tmp_path, "pp2_full_z2_dropout", "parallel.pp=2", "zero.stage=2", "train.recompute=full", *dropout),
        overrides(
            tmp_path,
            "pp2_vpp2_dropout",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
            "zero.stage=1",
            *dropout,
        ),
        overrides(
            tmp_path,
            "zb_full_z2_dropout",
            "parallel.pp=2",
            "parallel.schedule=zb_h1",
            "zero.stage=2",
            "train.recompute=full",
            "train.recompute_every=2",
            *dropout,
        ),
        overrides(tmp_path, "dp2_dropout", "zero.stage=1", "model.dropout=0.1"),
    ]
    *pipelines, dp2 = run_configs(2, runs, tmp_path)
    for result in pipelines:
        assert_follows(result, single)
    assert max_abs_diff(dp2["losses"], single["losses"]) <= TOL
    assert max_relative_diff(dp2["grad_norms"], single["grad_norms"]) <= TOL
