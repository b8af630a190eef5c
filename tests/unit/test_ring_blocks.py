"""Ring attention's block kernels against serial causal attention, the cp ranks run as threads of one process
(tools/bench_ring_blocks.py's ThreadRing, so one GPU is enough): output and dq, dk, dv of every rank, GQA,
cp 2 and 4. On CPU: the CPU flash kernel and the explicit path; on CUDA (when present, tools/bench_gpu.py runs these cases): FlashAttention-2 for bf16, the
memory-efficient kernel for fp32, and the explicit path. The fused cases also check that the fused kernel ran.
(tests/distributed/cp_worker.py checks the same over a real gloo ring, with dropout.)"""

import pytest
import torch

from megatron_lite.parallel import context_parallel as C
from megatron_lite.parallel.context_parallel import document_mask, fused_kernel, shard_sequence
from tools.bench_ring_blocks import ring_in_threads

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
# ||got - want|| / ||want|| against fp64: fp32 blocks only reorder sums; bf16 inputs round q, k, v, the
# blocks' outputs and dO to 8 bits of mantissa (one ulp is 0.4-0.8%).
# The memory-efficient CUDA kernel may round fp32 products to TF32 (10 bits of mantissa) on Ampere and later.
TOL = {("cpu", torch.float32): 2e-5, ("cuda", torch.float32): 2e-3, ("cuda", torch.bfloat16): 2e-2}


def serial(q, k, v, grad, segments=None):
    """Causal attention of the whole sequence in fp64 by autograd (within each document given segments (b, s)):
    output, dq, dk, dv."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    mask = None if segments is None else document_mask(segments, segments)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask, is_causal=mask is None
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


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("blocks", ["fused", "explicit"])
def test_ring_blocks_within_documents(blocks, cp):
    """data.document_mask: ring attention within each document against serial masked attention (CPU, fp32).
    Sample 0 has short documents, so some blocks lie wholly across documents (skipped) and some query rows see no
    key of a block; sample 1 is one document (unmasked blocks)."""
    b, heads, kv_heads, hd, s = 2, 4, 2, 16, 2 * cp * 24
    lengths = [5, 1, 30, 17, 2, 40, 9, 3, s]  # cut at s
    segments = torch.zeros(b, s, dtype=torch.long)
    segments[0] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:s]
    g = torch.Generator().manual_seed(7)
    q, k, v, grad = (torch.randn(b, h, s, hd, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    want = serial(q, k, v, grad, segments)
    C.block_counts.computed = C.block_counts.skipped = 0
    got = ring_in_threads(q, k, v, grad, cp, fused_kernel(q) if blocks == "fused" else None, segments)
    # both samples share each block: only blocks empty in both are skipped, so sample 1 keeps every block
    assert C.block_counts.skipped == 0 and C.block_counts.computed > 0
    for name, i in (("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        for r in range(cp):
            err = relative_error(got[r][i], shard_sequence(want[i], 2, cp, r))
            assert err < TOL["cpu", torch.float32], f"{name} of cp rank {r}: relative error {err:.2e}"
    # sample 0 alone: blocks wholly across its documents are skipped, and it still matches
    want = serial(*(x[:1] for x in (q, k, v, grad)), segments[:1])
    got = ring_in_threads(
        *(x[:1] for x in (q, k, v, grad)), cp, fused_kernel(q) if blocks == "fused" else None, segments[:1]
    )
    assert C.block_counts.skipped > 0, C.block_counts
    for name, i in (("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        for r in range(cp):
            err = relative_error(got[r][i], shard_sequence(want[i], 2, cp, r))
            assert err < TOL["cpu", torch.float32], f"sample 0: {name} of cp rank {r}: relative error {err:.2e}"
