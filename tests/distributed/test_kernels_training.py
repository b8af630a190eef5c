"""Training with kernels.backend=triton (Triton's interpreter on CPU) follows kernels.backend=torch.

Both presets (GPT-2 style: LayerNorm, bias-GeLU; Llama style: RMSNorm, RoPE, SwiGLU), fused cross entropy in both;
the Llama run also recomputes every layer, so kernels replay inside recomputation. The corpus is folded into a
512-token vocabulary, as in every trajectory test (tests/distributed/common.py): the interpreter's time goes by the
size of what the kernels touch. Tolerance 1e-4 on every per-step loss (absolute) and gradient norm (relative); the
kernels reorder fp32 reductions. Measured: losses 4.8e-7 (tiny) and 1.4e-6 (llama-tiny), gradient norms 7.1e-8 and
9.1e-7; ZeRO-3 tp=2 + SP against dp=2: 4.8e-7 and 2.0e-7.
"""

import os

import pytest

from tests.distributed.common import max_abs_diff, max_relative_diff, overrides
from tests.distributed.launcher import run_configs


@pytest.mark.slow  # ~70 s; the quick tier trains with Triton kernels in the test below
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_backend_follows_torch_backend(tmp_path):
    runs = []
    for preset, extra in (("tiny", []), ("llama-tiny", ["train.recompute=full"])):
        common = ["train.steps=4", f"model={preset}", "train.global_batch_size=4", "model.dropout=0.0"]
        runs.append(overrides(tmp_path, f"{preset}_torch", *common, "kernels.backend=torch"))
        runs.append(overrides(tmp_path, f"{preset}_triton", *common, "kernels.backend=triton", *extra))
    results = run_configs(1, runs, tmp_path)
    for torch_run, triton_run in zip(results[::2], results[1::2]):
        assert len(triton_run["losses"]) == 4
        gap = max_abs_diff(triton_run["losses"], torch_run["losses"])
        assert gap <= 1e-4, f"{triton_run['overrides']}: max |loss(triton) - loss(torch)| = {gap:.2e}"
        norms = max_relative_diff(triton_run["grad_norms"], torch_run["grad_norms"])
        assert norms <= 1e-4, f"{triton_run['overrides']}: grad norms differ by {norms:.2e} (relative)"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_backend_composes_with_zero3_and_tensor_sequence_parallel(tmp_path):
    """2 ranks, ZeRO-3: torch kernels at dp=2 against Triton kernels at tp=2 with SP (vocab-parallel cross
    entropy, fused bias-GeLU on column-parallel shards, norms on sequence shards); same global batch."""
    common = ["train.steps=3", "zero.stage=3"]
    torch_run, triton_run = run_configs(
        2,
        [
            overrides(tmp_path, "z3_torch", *common, "kernels.backend=torch"),
            overrides(
                tmp_path, "z3_triton_tp2_sp", *common, "kernels.backend=triton", "parallel.tp=2", "parallel.sp=true"
            ),
        ],
        tmp_path,
    )
    gap = max_abs_diff(triton_run["losses"], torch_run["losses"])
    assert gap <= 1e-4, f"ZeRO-3 tp=2 SP triton vs dp=2 torch: max |loss diff| = {gap:.2e}"
    norms = max_relative_diff(triton_run["grad_norms"], torch_run["grad_norms"])
    assert norms <= 1e-4, f"ZeRO-3 tp=2 SP triton vs dp=2 torch: grad norms differ by {norms:.2e} (relative)"
