"""kernels.backend: what `auto`, `torch` and `triton` choose per op, and that the model's modules take it."""

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.kernels import OPS, TRITON_FASTER_ON_CUDA, describe, resolve_backend
from megatron_lite.model.gpt import GPT
from tests.utils.models import LLAMA_STYLE

LLAMA = dict(
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_model=64,
    ffn_hidden=96,
    vocab_size=500,
    seq_len=32,
    **LLAMA_STYLE,
)


def test_auto_is_torch_on_cpu_and_triton_on_cuda_only_where_measured_faster():
    assert resolve_backend("auto", torch.device("cpu")) == dict.fromkeys(OPS, "torch")
    cuda = resolve_backend("auto", torch.device("cuda"))
    assert {op for op, b in cuda.items() if b == "triton"} == TRITON_FASTER_ON_CUDA
    assert cuda["layernorm"] == cuda["bias_gelu"] == "torch"  # measured slower / no faster on an H100
    assert resolve_backend("triton", torch.device("cpu")) == dict.fromkeys(OPS, "triton")
    assert describe(resolve_backend("torch", torch.device("cuda"))) == "torch"
    assert describe(cuda) == "torch for layernorm, bias_gelu; triton for rmsnorm, rope, swiglu, cross_entropy"


def test_each_module_takes_its_ops_backend():
    model = GPT(ModelConfig(**LLAMA))
    model.set_kernels(resolve_backend("auto", torch.device("cuda")))
    seen = {type(m).__name__: m.kernel_backend for m in model.modules() if hasattr(m, "kernel_backend")}
    assert seen == {"RMSNorm": "triton", "Attention": "triton", "MLP": "triton", "LMHead": "triton"}, seen
    gpt2 = GPT(ModelConfig(n_layers=1, n_heads=4, d_model=64, vocab_size=500, seq_len=32))
    gpt2.set_kernels(resolve_backend("auto", torch.device("cuda")))
    seen = {type(m).__name__: m.kernel_backend for m in gpt2.modules() if hasattr(m, "kernel_backend")}
    assert seen == {"LayerNorm": "torch", "Attention": "triton", "MLP": "torch", "LMHead": "triton"}, seen
