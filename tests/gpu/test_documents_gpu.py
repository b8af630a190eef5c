"""On CUDA: data.document_mask's variable-length FlashAttention path (model/documents.varlen_attention) against SDPA
with the block-diagonal causal mask, output and gradients in bf16, with GQA; and that the model takes it."""

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.data.documents import Windows
from megatron_lite.model import documents
from megatron_lite.model.documents import DocumentMask, varlen_applies, varlen_attention
from megatron_lite.model.gpt import GPT
from megatron_lite.parallel.context_parallel import document_mask
from tests.utils.models import LLAMA_STYLE

DEVICE = "cuda"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _windows(b: int, s: int, lengths: list[int]) -> Windows:
    """Windows whose documents have these lengths (cut at s), the last window one document."""
    positions = torch.zeros(b, s + 1, dtype=torch.long)
    row = torch.cat([torch.arange(n) for n in lengths])[: s + 1]
    positions[0, : len(row)] = row
    positions[1:] = torch.arange(s + 1)
    tokens = torch.randint(1, 1000, (b, s + 1))
    return Windows(tokens, positions, loss_tokens=float((positions[:, 1:] != 0).sum()))


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_attention_equals_masked_sdpa(kv_heads):
    b, heads, s, hd = 2, 8, 512, 64
    docs = DocumentMask.of(_windows(b, s, [100, 1, 37, 200, 3, 300]).to(DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (
        torch.randn(b, h, s, hd, device=DEVICE, generator=g, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads)
    )
    assert varlen_applies(q)
    grad = torch.randn(b, heads, s, hd, device=DEVICE, generator=g, dtype=torch.bfloat16)
    results = []
    for fn in (
        lambda q, k, v: varlen_attention(q, k, v, docs),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=document_mask(docs.segments, docs.segments), enable_gqa=True
        ),
    ):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(out.dtype))
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, got, want in zip(("output", "dq", "dk", "dv"), *results):
        assert relative_error(got, want) < 2e-2, (name, relative_error(got, want))


def test_the_model_takes_the_varlen_path_on_cuda(monkeypatch):
    """A bf16 llama-style model with the mask: the variable-length kernel runs, and its loss matches the
    masked-SDPA path's (the same model with the kernel switched off)."""
    cfg = ModelConfig(
        n_layers=2, n_heads=8, n_kv_heads=2, d_model=512, ffn_hidden=1024, vocab_size=1000, seq_len=256,
        **LLAMA_STYLE,
    )  # fmt: skip
    model = GPT(cfg, device=DEVICE).to(torch.bfloat16)
    windows = _windows(2, 256, [10, 90, 1, 60, 200]).to(DEVICE)
    calls = []
    real = documents.varlen_attention
    monkeypatch.setattr("megatron_lite.model.gpt.varlen_attention", lambda *a: calls.append(1) or real(*a))
    varlen = model(windows.tokens[:, :-1], windows.tokens[:, 1:], documents=windows)
    assert len(calls) == cfg.n_layers
    monkeypatch.setattr("megatron_lite.model.gpt.varlen_applies", lambda q: False)
    masked = model(windows.tokens[:, :-1], windows.tokens[:, 1:], documents=windows)
    assert abs(varlen.item() - masked.item()) < 2e-2 * masked.item()
