"""On CUDA: the whole model with kernels.backend=triton against the torch references, fp32 and bf16, both
flavours, loss and every gradient. (The per-kernel comparisons in tests/unit/test_kernels_*.py also run on
CUDA when it is present: they are parametrized over the device.)"""

import copy

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from tests.utils.models import LLAMA_STYLE

FLAVOURS = {
    "gpt2": dict(n_layers=2, n_heads=6, d_model=384, vocab_size=5003, seq_len=256),
    "llama-gqa": dict(
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        d_model=384,
        ffn_hidden=1000,
        vocab_size=5003,
        seq_len=256,
        **LLAMA_STYLE,
    ),
}
# Relative error ||a - b|| / ||b|| per tensor: fp32 kernels only reorder reductions; in bf16 the fused code
# rounds intermediates at other places than the unfused torch ops (one bf16 ulp is 0.8%).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DEVICE = "cuda"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def assert_follows(model: GPT, reference: GPT, tol: float) -> None:
    """One forward and backward of each on the same tokens: loss within tol / 10, every gradient within tol."""
    tokens = torch.randint(0, 5003, (4, 257), device=DEVICE)
    losses = []
    for m in (reference, model):
        loss = m(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.float())
    assert relative_error(losses[1], losses[0]) <= tol / 10, losses
    params = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        error = relative_error(params[name].grad, p.grad)
        assert error <= tol, f"{name}: relative gradient error {error:.2e} (bf16 ulp 7.8e-3)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_triton_model_matches_torch_model(flavour, dtype):
    torch.manual_seed(0)
    reference = GPT(ModelConfig(**FLAVOURS[flavour])).to(DEVICE, dtype)
    fused = copy.deepcopy(reference)
    fused.set_kernels("triton")
    assert_follows(fused, reference, TOL[dtype])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_compiled_triton_blocks_share_one_graph(flavour):
    """train.compile with every op on Triton, bf16 (ours-compile in bench-gpu, and kernels.backend=auto's
    Triton ops inside compiled Llama blocks): the blocks share one graph with the Triton kernels in it, no graph
    break, and loss and every gradient follow the eager Triton model. On CPU this cannot run: dynamo traces
    into Triton's interpreter instead of taking the kernel as one op."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = GPT(ModelConfig(**FLAVOURS[flavour])).to(DEVICE, torch.bfloat16)
    eager.set_kernels("triton")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_blocks()
    assert_follows(compiled, eager, TOL[torch.bfloat16])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
        dict(counters["stats"]),
        dict(counters["graph_break"]),
    )
