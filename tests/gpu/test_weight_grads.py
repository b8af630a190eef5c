"""On CUDA: under bf16 autocast with fp32 parameters a linear's weight gradients come from cuBLAS's fp32-output
matmul (parallel/weight_grad.py, linear_weight_grads), autocast's output and input gradient unchanged."""

import pytest

from tests.unit.test_weight_grad import check_autocast_weight_gradients_in_fp32


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_autocast_weight_gradients_are_made_in_fp32_on_cuda(split):
    check_autocast_weight_gradients_in_fp32("cuda", split)
