"""The FLOPs model (MFU/HFU) and the peak FLOP/s of a device, which MFU is taken against.

FLOPs convention (DESIGN §2; docs/performance.md states it for users): an exact count of the GEMMs, 2 FLOPs per
multiply-add. With h = d_model, a = n_heads, k = n_kv_heads, d = h / a, f = ffn_hidden, s = seq_len,
V = vocab_size (the true vocabulary, not the padded embedding), one token costs in the forward pass

    per layer   QKV projection       2 h (a + 2k) d
                attention scores     2 s a d  x 1/2      (QK^T: s keys per query head; causal needs half)
                attention x values   2 s a d  x 1/2
                output projection    2 a d h
                MLP                  2 h f  x 2 (GeLU: fc_in, fc_out) or x 3 (SwiGLU: gate, up, fc_out)
    once        LM head              2 h V

    F_fwd = n_layers (dense + core) + 2 h V,   model FLOPs per token = 3 F_fwd
(forward, input gradient, weight gradient; Megatron-LM's "12 x" expansion, Narayanan et al. 2021,
appendix). Causal attention is counted at exactly half of the full s x s score matrix (s/2 keys per
query, as Megatron-LM's causal count and MaxText do), not the (s+1)/2 of the lower triangle including
the diagonal. With data.document_mask a query attends only within its document, so a step's attention counts
sum over its documents of length² instead of windows x s² (`step_flops(attended=...)`). Not counted: embedding
lookups, norms, softmax, RoPE, biases and other element-wise work.
HFU adds the forward work that activation recomputation repeats in backward: each recomputed layer but
its last GEMM for `full`, the attention core for `selective` (recompute_flops_per_token says exactly what
torch reruns); the LM head is never recomputed.

Left out on purpose: MoE and multi-token-prediction terms (no such models here).
"""

from __future__ import annotations

import functools
import time

import torch

from megatron_lite.config import ModelConfig

RECOMPUTE_MODES = ("none", "selective", "full")


# Dense (no 2:4 sparsity) peak FLOP/s per device, from NVIDIA's datasheets: "NVIDIA H100 Tensor Core GPU"
# (SXM / PCIe / NVL columns), "NVIDIA H200 Tensor Core GPU" (SXM / NVL), "NVIDIA A100 Tensor Core GPU".
# The datasheets print tensor-core figures "with sparsity"; dense is half of those. bf16 also serves fp16;
# "fp32" is the plain CUDA-core rate, "tf32" the tensor-core rate that fp32 matmuls get when TF32 is allowed.
# Rows are matched in order against torch.cuda.get_device_name (every fragment must occur), most specific
# first; e.g. "NVIDIA H100 80GB HBM3" is the SXM part, and "NVIDIA GH200 480GB" matches the H200 row, whose
# figures equal the GH200's.
PEAK_TABLE: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    (("H100", "PCIe"), "H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (("H100", "NVL"), "H100 NVL", {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("H200", "NVL"), "H200 NVL", {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("H200",), "H200 SXM", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    (("H100",), "H100 SXM", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    (("A100",), "A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)


def layer_flops_per_token(cfg: ModelConfig, seq_len: float, causal: bool = True) -> tuple[int, int]:
    """Forward FLOPs per token of one transformer layer, split as (dense projections, attention core).

    dense = 2 h (a + 2k) d + 2 a d h + 2 h f m  (m = 2 for GeLU, 3 for SwiGLU);
    core = 2 * 2 s a d, halved when causal (scores QK^T and probabilities x V).
    """
    h, a, k, d, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
    qkv = 2 * h * (a + 2 * k) * d
    out = 2 * a * d * h
    mlp = 2 * h * f * (3 if cfg.activation == "swiglu" else 2)
    core = 2 * 2 * seq_len * a * d  # scores + values, the full s x s matrix
    half = core / 2 if isinstance(core, float) else core // 2  # 4 s a d is even, so the half is exact
    return qkv + out + mlp, half if causal else core


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> int:
    """F_fwd = n_layers (dense + core) + 2 h V (LM head over the true vocabulary)."""
    dense, core = layer_flops_per_token(cfg, seq_len, causal)
    return cfg.n_layers * (dense + core) + 2 * cfg.d_model * cfg.vocab_size


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token, 3 F_fwd, with (h, a, k, d, f, s, V as in the module docstring)

        F_fwd = L [2h(a+2k)d + 2adh + 2hf·m + 2sad·(1/2 if causal else 1)] + 2hV,  m = 2 (GeLU) or 3 (SwiGLU).

    `causal=False` counts the full score matrix (what torch's FlopCounterMode sees in SDPA's math path).
    """
    return float(3 * forward_flops_per_token(cfg, seq_len, causal))


def recompute_flops_per_token(
    cfg: ModelConfig, seq_len: int, recompute: str, every: int = 1, fused_core: bool = True, causal: bool = True
) -> int:
    """Forward FLOPs per token that activation recomputation reruns during backward.

    torch stops a recomputation once every tensor backward needs is rebuilt (checkpoint early stop), so the
    last GEMM of a recomputed region, whose output nothing keeps, never reruns: `full` reruns each of its
    ceil(L / every) layers except fc_out (2 f h); `selective` reruns the attention core, whole when SDPA is
    one fused op (flash / memory-efficient on GPU, the CPU flash kernel), only QK^T on the math path (what
    CPU uses with attention dropout).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    dense, core = layer_flops_per_token(cfg, seq_len, causal)
    if recompute == "full":
        return -(-cfg.n_layers // every) * (dense - 2 * cfg.ffn * cfg.d_model + core)  # blocks 0, every, ...
    if recompute == "selective":
        return cfg.n_layers * (core if fused_core else core // 2)
    return 0


def step_flops(
    cfg: ModelConfig,
    tokens: int,
    recompute: str = "none",
    recompute_every: int = 1,
    fused_core: bool = True,
    attended: int | None = None,
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a training step over `tokens` tokens of sequences cfg.seq_len long, or,
    with data.document_mask, whose attention spans documents whose lengths squared sum to `attended`.

    hardware = model + what recomputation reruns (recompute_flops_per_token). MFU = model / (time x devices
    x peak); HFU likewise with hardware.
    """
    span = cfg.seq_len if attended is None else attended / tokens  # a token's causal attention costs as over s
    extra = recompute_flops_per_token(cfg, span, recompute, recompute_every, fused_core)
    model = 3 * forward_flops_per_token(cfg, span) * tokens
    return float(model), float(model + extra * tokens)


def _cuda_tf32_allowed() -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores (torch's new fp32_precision API or the legacy flag)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # torch refuses to answer when the legacy and new APIs were mixed
        return False


@functools.cache
def _probe_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int, budget_s: float) -> float:
    """Best FLOP/s of up to `repeats` n x n x n matmuls (2 n^3 FLOPs each) after one warm-up, within `budget_s`.
    A warm-up that alone spends the budget is the one timing (bf16 on a CPU without bf16 units: 2.5-4 s a 1024^3
    matmul on one thread; three calls cost a bf16 CPU run 7.7 s); its one-time costs are small beside it."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    torch.mm(a, b)
    sync()
    times = [time.perf_counter() - start]
    while len(times) <= repeats and time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - t0)
    best = min(times[1:]) if len(times) > 1 else times[0]  # the warm-up counts only when it is all there is
    return 2 * n**3 / best


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where that number comes from), for MFU's denominator.

    CUDA: the datasheet table above, keyed by torch.cuda.get_device_name; a GPU not in it is probed
    (8192^3 matmuls). CPU: there is no meaningful datasheet figure, so a short probe measures it (best of up
    to 5 1024^3 matmuls on torch's current threads within 0.3 s, or the warm-up alone where one matmul takes
    longer, as bf16 does on CPUs without bf16 units) and says so; a loaded
    machine measures low, which inflates MFU. Probes are cached per (device, dtype).
    """
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        key = {torch.bfloat16: "bf16", torch.float16: "bf16"}.get(dtype)
        if dtype == torch.float32:
            key = "tf32" if _cuda_tf32_allowed() else "fp32"
        for fragments, part, peaks in PEAK_TABLE:
            if key and all(frag in gpu for frag in fragments):
                return peaks[key], f"{part} {key} dense datasheet peak for {gpu}"
        flops = _probe_flops(device, dtype, 8192, 5, 2.0)
        return flops, f"probed: best of 5 {name} 8192^3 matmuls on {gpu} (not in the peak table)"
    flops = _probe_flops(device, dtype, 1024, 5, 0.3)
    return flops, f"probed: best of up to 5 {name} 1024^3 matmuls on {torch.get_num_threads()} CPU threads"
