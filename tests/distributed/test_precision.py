"""bf16 training on CPU (torch runs bf16 matmuls there) against fp32, on every ZeRO stage.

1. Trajectories (tests/distributed/common.py; 4 steps for the per-stage runs, 6 for TP): every ZeRO stage at
   dp=1 and dp=2, and tp=2 x SP
   (ZeRO-0, whose autocast path runs the sequence-parallel matmuls on fp32 weights, and ZeRO-1), each against
   the fp32 run of the same layout and against each other. The tiny model with the trajectory tests' 512-token
   vocabulary (the corpus folded into it): bf16 matmuls are slow on a CPU without bf16 units, and the 8192-token
   head took half of these tests' time; the precision path does not depend on the head's width.
   bf16 rounds activations and weights (8 bits of mantissa, 2^-9 relative), so bf16 and fp32 part by a few
   1e-4; measured at dp 1 (6 steps), dp 2 and tp=2 SP: losses <= 3.9e-4 from fp32, gradient norms <= 1.7e-3
   (relative); ZeRO 1-3 (DeepSpeed's bf16 parameters) from each other <= 8.8e-5 and 1.5e-4, from ZeRO-0 (fp32
   weights under autocast) <= 4.5e-4 and 4.7e-4. With the 8192-token head the gaps were up to 7.1e-4 and
   3.4e-3. Tolerances: 3e-3 on the loss (absolute), 1.5e-2 on the norm (relative); a gradient off by a factor
   (a wrong accumulation or DP scale) moves the norm by that factor.
2. Accumulation (engine.py; docs/precision.md, "Mixed precision"): 256 micro-batches, every one the same sequence
   (the data is a sequence repeated), so each adds the same 1/256 of the gradient. Summed in fp32 that is exact;
   summed in bf16 the running sum loses the addends' low bits as it grows. Measured (one layer, a 512-token
   vocabulary): ZeRO 0-3 bf16 within 7.5e-4 of the fp32 run's gradient norm (ZeRO 1-3 hold bf16 weights);
   with DeepSpeed told to accumulate in bf16 (data_types.grad_accum_dtype) ZeRO 1-3 are 1.57e-2 off.
   Tolerance 3.5e-3, about 4.5x from each.
"""

import numpy as np
import pytest

from tests.distributed.common import max_abs_diff, max_relative_diff, overrides, write_prepared
from tests.distributed.launcher import run_configs

LOSS_TOL, NORM_TOL = 3e-3, 1.5e-2
BF16 = "train.precision=bf16"


def assert_close(result: dict, reference: dict, what: str, loss_tol: float, norm_tol: float) -> None:
    gap = max_abs_diff(result["losses"], reference["losses"])
    assert gap <= loss_tol, f"{what}: max |loss gap| = {gap:.2e} > {loss_tol:.0e}"
    norms = max_relative_diff(result["grad_norms"], reference["grad_norms"])
    assert norms <= norm_tol, f"{what}: grad norms differ by {norms:.2e} (relative) > {norm_tol:.0e}"


def check_stages(results: dict, layout: str) -> None:
    """results: 'fp32' and one bf16 run per ZeRO stage (keys 0..3) of the same layout."""
    for stage in (0, 1, 2, 3):
        assert_close(results[stage], results["fp32"], f"{layout} ZeRO-{stage} bf16 vs fp32", LOSS_TOL, NORM_TOL)
        for other in range(stage):
            assert_close(
                results[stage], results[other], f"{layout} ZeRO-{stage} vs ZeRO-{other}, bf16", LOSS_TOL, NORM_TOL
            )


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp1", "dp2"])
def test_bf16_follows_fp32_on_every_zero_stage(nproc, tmp_path):
    """Four of the usual six steps (five runs each; the suite's time); the gaps above at dp 1 are 6-step maxima."""
    common = ["train.steps=4"]
    runs = [overrides(tmp_path, "fp32", *common)] + [
        overrides(tmp_path, f"bf16_z{s}", BF16, f"zero.stage={s}", *common) for s in (0, 1, 2, 3)
    ]
    out = run_configs(nproc, runs, tmp_path)
    check_stages(dict(zip(["fp32", 0, 1, 2, 3], out)), f"dp={nproc}")


@pytest.mark.slow
def test_bf16_tensor_and_sequence_parallel(tmp_path):
    tp = ["parallel.tp=2", "parallel.sp=true"]
    runs = [overrides(tmp_path, "fp32", *tp)] + [
        overrides(tmp_path, f"bf16_z{s}", *tp, BF16, f"zero.stage={s}") for s in (0, 1)
    ]
    fp32, z0, z1 = run_configs(2, runs, tmp_path)
    for stage, result in ((0, z0), (1, z1)):
        assert_close(result, fp32, f"tp=2 SP ZeRO-{stage} bf16 vs fp32", LOSS_TOL, NORM_TOL)
    assert_close(z1, z0, "tp=2 SP ZeRO-1 bf16 vs ZeRO-0 bf16", LOSS_TOL, NORM_TOL)


def repeated_sequence_data(path, seq_len: int, vocab: int = 8192) -> str:
    """A prepared data directory whose every training window is the same sequence (period = seq_len)."""
    seq = np.random.default_rng(0).integers(0, vocab - 192, seq_len)
    return write_prepared(path, {"train": np.tile(seq, 1100), "val": np.tile(seq, 4)}, vocab)


def test_bf16_accumulates_gradients_in_fp32(tmp_path):
    """256 micro-batches of one sequence, so every micro-batch adds the same gradient (module docstring, 2)."""
    data = repeated_sequence_data(tmp_path / "data", seq_len=16, vocab=512)
    # One layer and 512 tokens: the accumulation, not the depth or the head, is under test (bf16 matmuls on a CPU
    # without bf16 units run at ~1 GFLOP/s, so the 8192-token head took most of this test's 76 s).
    many = [
        "train.steps=1",
        "train.global_batch_size=256",
        "train.micro_batch_size=1",
        f"data.path={data}",
        "model.seq_len=16",
        "model.n_layers=1",
        "model.vocab_size=512",
    ]
    runs = [overrides(tmp_path, "fp32", *many)] + [
        overrides(tmp_path, f"bf16_z{s}", *many, BF16, f"zero.stage={s}") for s in (0, 1, 2, 3)
    ]
    fp32, *bf16 = run_configs(1, runs, tmp_path)
    for stage, result in enumerate(bf16):
        off = max_relative_diff(result["grad_norms"], fp32["grad_norms"])
        assert off <= 3.5e-3, (
            f"ZeRO-{stage} bf16: the norm of 256 accumulated micro-batch gradients is {off:.2%} off "
            f"the fp32 run's ({result['grad_norms']} vs {fp32['grad_norms']}); are gradients "
            "accumulated in bf16?"
        )
