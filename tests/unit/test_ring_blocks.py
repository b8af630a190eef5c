"""Ring attention's block kernels against serial causal attention, the cp ranks run as threads of one process
(tools/bench_ring_blocks.py's ThreadRing, so one GPU is enough): output and dq, dk, dv of every rank, GQA,
cp 2 and 4. On CPU: the CPU flash kernel and the explicit path; on CUDA (when present, tools/bench_gpu.py runs these cases): FlashAttention-2 for bf16, the
memory-efficient kernel for fp32, and the explicit path. The fused cases also check that the fused kernel ran.
(tests/distributed/cp_worker.py checks the same over a real gloo ring, with dropout.)"""

import pytest
import torch

from megatron_lite.parallel import context_parallel as C
from megatron_lite.parallel.context_parallel import fused_kernel, shard_sequence
from tools.bench_ring_blocks import ring_in_threads

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
# ||got - want|| / ||want|| against fp64: fp32 blocks only reorder sums; bf16 inputs round q, k, v, the
# blocks' outputs and dO to 8 bits of mantissa (one ulp is 0.4-0.8%).
# The memory-efficient CUDA kernel may round fp32 products to TF32 (10 bits of mantissa) on Ampere and later.
TOL = {("cpu", torch.float32): 2e-5, ("cuda", torch.float32): 2e-3, ("cuda", torch.bfloat16): 2e-2}


def serial(q, k, v, grad):
    """Causal attention of the whole sequence in fp64 by autograd: output, dq, dk, dv."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True
    )
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def relative_error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def cases():
    for device in DEVICES:
        for dtype in (torch.float32, torch.bfloat16):
            if device == "cpu" and dtype == torch.bfloat16:
                continue  # the CPU kernel computes in fp32 whatever comes in
            for blocks in ("fused", "explicit"):
                yield pytest.param(device, dtype, blocks, id=f"{device}-{str(dtype)[6:]}-{blocks}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("device, dtype, blocks", list(cases()))
def test_ring_blocks_match_serial_attention(device, dtype, blocks, cp):
    b, heads, kv_heads, hd = 2, 8, 2, 64
    s = 2 * cp * (96 if device == "cuda" else 24)  # chunks not a multiple of the kernels' tiles
    g = torch.Generator().manual_seed(5)
    q, k, v, grad = (
        torch.randn(b, h, s, hd, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    want = serial(q, k, v, grad)
    kernel = fused_kernel(q) if blocks == "fused" else None
    if blocks == "fused":
        assert kernel == ("cpu" if device == "cpu" else {torch.bfloat16: "flash", torch.float32: "efficient"}[dtype])
    calls, fused_forward = [], C._fused_forward
    C._fused_forward = lambda *args: calls.append(args[0]) or fused_forward(*args)
    try:
        got = ring_in_threads(q, k, v, grad, cp, kernel)
    finally:
        C._fused_forward = fused_forward
    assert set(calls) == ({kernel} if kernel else set()), (kernel, set(calls))
    for name, i in (("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        whole = want[i]
        for r in range(cp):
            assert got[r][i].dtype == dtype, (name, got[r][i].dtype)
            err = relative_error(got[r][i], shard_sequence(whole, 2, cp, r))
            tol = TOL[device, dtype]
            assert err < tol, f"{name} of cp rank {r}: relative error {err:.2e} (tolerance {tol:.0e})"
