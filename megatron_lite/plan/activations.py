"""Activation bytes: what autograd keeps for backward, per transformer layer and per micro-batch, on one rank.

The terms are Korthikanti et al. 2022 (§4, eq. 1-2: 34sbh + 5as²b bytes per layer in fp16 terms, ÷t for the
parts tensor or sequence parallelism splits), written out tensor by tensor for *our* layers with their real
dtypes, so that they can be held exactly against what autograd saves (tests/unit/test_plan.py counts the saved
tensors of the real model). Where we differ from the paper, and why:
  - flash attention (a GPU, or a CPU without attention dropout) keeps q, k, v, its output and a per-row
    log-sum-exp instead of the s²-sized scores, probabilities and mask: the 5as²b term is gone, b·s·h·a/t
    elements (the output) and an fp32 row statistic come in. The math path (CPU with attention dropout) keeps
    softmax output, a float dropout mask and the dropped probabilities: three as²b terms.
  - the attention output is kept once: a fused kernel's (and ring attention's) output is laid out (b, s, heads,
    hd), so the output projection's input in token order is a view of it. Ulysses keeps two: SDPA's output over its
    heads, and the projection's copy of what the all-to-all brings back.
  - norms keep their input and fp32 statistics (LayerNorm: mean and 1/std; RMSNorm: 1/rms, recomputing the
    normalised input in backward, as its Triton kernel does).
  - SwiGLU keeps [gate | up] and the product: 3f per token (both kernels recompute silu(gate) in backward);
    GeLU the pre- and post-activation: 2f.
  - residual dropout keeps a bool mask (1 byte); attention dropout is fused into SDPA (flash) or a float mask.
  - ZeRO-0 under bf16 autocast keeps the residual stream and norms in fp32 and each matmul's bf16 input copy;
    the bf16 copy of every weight it multiplies is made once a step and shared by its micro-batches
    (parallel/weight_grad.py one_copy_per_step), so plan/memory.py counts it once per rank, not per micro-batch.
The kernels are counted as kernels.backend=auto picks them: on a GPU the Triton cross entropy (the logits in their
dtype, overwritten by their gradient, where torch's path keeps an fp32 log-softmax and two more buffers in
backward) and fp32 norm statistics; RMSNorm and SwiGLU keep the same on either path. Counted exact against autograd
for both backends (tests/unit/test_plan.py, Triton's interpreter on CPU). kernels.backend=torch on a GPU keeps
more at the head than priced.

Recomputation: `selective` drops the attention core's tensors and keeps its inputs (q, k, v); `full` keeps only
each recomputed layer's input, and its backward briefly rebuilds that one layer (counted as a transient).
Context parallelism divides the sequence: every term uses this rank's s/cp tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.plan.params import block_linears, model_key, padded_vocab

F32, I64, BOOL = 4, 8, 1


@dataclass(frozen=True)
class MicroShape:
    """One micro-batch on one rank: the sizes and dtypes that decide its activations."""

    b: int  # micro-batch size
    s: int  # tokens of each sequence on this rank: seq_len / cp
    tp: int
    sp: bool
    cp: int
    cp_mode: str  # ring | ulysses
    flash: bool  # fused attention (keeps out + lse) rather than the math path (keeps the s² scores)
    act: int  # bytes per element of matmul outputs: 2 (bf16) or 4
    res: int  # bytes per element of the residual stream and norms (4 under ZeRO-0's bf16 autocast)
    autocast: bool  # ZeRO-0 bf16: matmuls save a bf16 copy of their input
    dropout: bool
    stats: int = 4  # bytes of a LayerNorm statistic: fp32 on a GPU, the input's dtype on a CPU
    math: int = 4  # bytes per element of the math attention path's tensors (CPU: fp32 whatever the input)
    f32_wgrad: bool = False  # a CPU under autocast: a linear's fp32 weight gradient multiplies fp32 copies
    triton_ce: bool = False  # the Triton cross entropy (kernels.backend=auto on CUDA): keeps the logits as they are

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch in the tensor-parallel region (the whole local sequence)."""
        return self.b * self.s

    @property
    def res_tokens(self) -> int:
        """Tokens per micro-batch in the residual region: a 1/tp sequence shard under SP."""
        return self.tokens // self.tp if self.sp else self.tokens


def _norm(cfg: ModelConfig, x: MicroShape) -> dict[str, int]:
    """What a norm keeps: its input, statistics, and its output as the next matmul keeps it."""
    R, h = x.res_tokens, cfg.d_model
    if cfg.norm == "layernorm":
        kept = {"in": R * h * x.res, "stats": 2 * R * x.stats}
    else:  # kernels/rmsnorm.py, either kernel: x in the stream's dtype and the fp32 1/rms
        kept = {"in": R * h * x.res, "stats": R * F32}
    if x.autocast and not x.sp:  # the matmul casts its input to bf16 and keeps that copy
        kept["out"] = x.tokens * h * 2
    else:  # SP: the column-parallel matmul keeps the sequence shard it gathers (parallel/layers.py)
        kept["out"] = R * h * x.res
    return kept


def block_saved(cfg: ModelConfig, x: MicroShape) -> dict[str, int]:
    """Bytes one block keeps for backward per micro-batch, by tensor, with recompute=none."""
    T, R, h, d = x.tokens, x.res_tokens, cfg.d_model, cfg.head_dim
    a, k, f = cfg.n_heads // x.tp, cfg.kv_heads // x.tp, cfg.ffn // x.tp
    n1, n2 = _norm(cfg, x), _norm(cfg, x)
    out = {
        "norm1.in": n1["in"],
        "norm1.stats": n1["stats"],
        "qkv.in": n1["out"],
        "proj.in": T * a * d * x.act,  # flash: the kernel's own output, of which this is a view
        "norm2.in": n2["in"],
        "norm2.stats": n2["stats"],
        "fc_in.in": n2["out"],
        "mlp.act": T * f * (3 if cfg.activation == "swiglu" else 2) * x.act,  # see module docstring
    }
    out.update(attention_saved(cfg, x, a, k))
    if x.dropout:
        out["drop.masks"] = 2 * R * h * BOOL
    return out


def core_inputs(cfg: ModelConfig, x: MicroShape, a: int, k: int) -> dict[str, int]:
    """q, k and v as the attention block hands them to its core: views of the fused projection's output, and
    with RoPE new rotated q and k (v stays a view that keeps the projection's output alive)."""
    T, d = x.tokens, cfg.head_dim
    out = {"qkv.out": T * (a + 2 * k) * d * x.act}
    if cfg.position == "rope":
        out["rope.qk"] = T * (a + k) * d * x.act
        if x.cp > 1:  # the cos/sin rows of this rank's positions, gathered per layer
            out["rope.rows"] = 2 * x.s * d * F32
    return out


def attention_saved(cfg: ModelConfig, x: MicroShape, a: int, k: int) -> dict[str, int]:
    """q, k, v as the core keeps them, and what the core itself keeps."""
    T, d = x.tokens, cfg.head_dim
    ring = x.cp > 1 and x.cp_mode == "ring"  # keeps q, k, v, its merged output and log-sum-exp on every path
    if not x.flash and not ring:  # math SDPA: fp32 copies of q, k, v (K/V heads repeated to the query heads),
        # softmax output, float dropout mask and dropped probabilities; Ulysses: a/cp heads of the whole sequence
        s_full = x.s * x.cp
        out = {"core.qkv": 3 * T * a * d * x.math, "core.scores": 3 * x.b * (a // x.cp) * s_full * s_full * x.math}
        if x.cp > 1:
            out["core.out"] = T * a * d * x.act
            if cfg.position == "rope":
                out["rope.rows"] = 2 * x.s * d * F32
        return out
    if x.cp > 1 and x.cp_mode == "ulysses":  # SDPA keeps the all-to-all outputs; the originals are let go
        inputs = {"core.qkv": T * (a + 2 * k) * d * x.act}
        if cfg.position == "rope":
            inputs["rope.rows"] = 2 * x.s * d * F32
    else:
        inputs = core_inputs(cfg, x, a, k)
    out = {**inputs, "core.lse": T * a * F32}
    if x.cp > 1 and x.cp_mode == "ulysses":  # the projection's input is the all-to-all's copy of SDPA's output
        out["core.out"] = T * a * d * x.act
    # (a fused kernel's output, and ring attention's merged one, are laid out (b, s, heads, hd): the projection's
    # input is a view of it)
    return out


def selective_saved(cfg: ModelConfig, x: MicroShape) -> dict[str, int]:
    """recompute=selective: the core's own tensors are dropped, its inputs (q, k, v) are kept."""
    out = {key: v for key, v in block_saved(cfg, x).items() if not key.startswith(("core.", "qkv.out", "rope."))}
    return {**out, **core_inputs(cfg, x, cfg.n_heads // x.tp, cfg.kv_heads // x.tp)}


def layer_bytes(cfg: ModelConfig, x: MicroShape, recompute: str) -> int:
    """Bytes one layer keeps per micro-batch: its full set, the selective set, or (full) only its input."""
    return _layer_bytes(model_key(cfg), x, recompute)


@functools.lru_cache(maxsize=65536)
def _layer_bytes(key: tuple, x: MicroShape, recompute: str) -> int:
    cfg = ModelConfig(*key)
    if recompute == "full":
        return x.res_tokens * cfg.d_model * x.res
    saved = selective_saved(cfg, x) if recompute == "selective" else block_saved(cfg, x)
    return sum(saved.values())


def layer_backward_transient(cfg: ModelConfig, x: MicroShape) -> int:
    """The most a layer's backward allocates on top of what is kept: the MLP's input and activation gradients
    (b·s·f each, twice for SwiGLU's two halves) while its saved tensors are still held. On a CPU under autocast
    (x.f32_wgrad) a linear's weight gradient also holds fp32 copies of both bf16 operands, its input and its
    output gradient (parallel/weight_grad.py linear_weight_grads; CUDA's matmul writes fp32 from bf16 instead):
    the widest linear's, b·s·(in + out) fp32 elements."""
    f = cfg.ffn // x.tp
    out = x.tokens * f * (4 if cfg.activation == "swiglu" else 2) * x.act
    if x.f32_wgrad:
        out += x.tokens * max(rows + cols for rows, cols in block_linears(cfg, x.tp).values()) * F32
    return out


def embedding_saved(cfg: ModelConfig, x: MicroShape) -> int:
    """The token ids (and, under TP, their local ids and out-of-range mask), positions, the dropout mask."""
    out = x.b * (x.s + 1) * I64 + (x.tokens * (I64 + BOOL) if x.tp > 1 else 0)  # the micro-batch, labels included
    if cfg.position == "learned":
        out += x.s * I64
    if x.dropout:
        out += x.res_tokens * cfg.d_model * BOOL
    return out


def head_vocab(cfg: ModelConfig, tp: int) -> int:
    """Logit columns per rank: the true vocabulary at tp=1, a padded vocabulary shard under TP."""
    return cfg.vocab_size if tp == 1 else padded_vocab(cfg, tp) // tp


def head_saved(cfg: ModelConfig, x: MicroShape) -> int:
    """The final norm, the head's input and what the cross entropy keeps: the torch path its fp32 (log-)softmax
    over this rank's real columns; the Triton kernel the logits themselves (every padded column, in their dtype)
    and two fp32 row statistics."""
    T, h = x.tokens, cfg.d_model
    norm = _norm(cfg, x)
    if x.sp:  # the head keeps the sequence it gathers, not the norm's shard
        norm["out"] = T * h * x.act
    if x.triton_ce:  # kernels/cross_entropy.py: logits, a contiguous copy of the labels, row max and sum of exp
        return sum(norm.values()) + T * padded_vocab(cfg, x.tp) // x.tp * x.act + T * I64 + 2 * T * F32
    labels = T * (I64 + BOOL) if x.tp > 1 else T * I64  # TP: local ids and ownership mask; else a copy
    loss = F32  # the mean's input size
    return sum(norm.values()) + T * head_vocab(cfg, x.tp) * F32 + labels + loss


def head_backward_transient(cfg: ModelConfig, x: MicroShape) -> int:
    """The torch cross entropy's backward holds two more fp32 buffers of the logits' size next to the kept one;
    the Triton kernel writes the gradient over the logits it kept."""
    return 0 if x.triton_ce else 2 * x.tokens * head_vocab(cfg, x.tp) * F32


def autocast_weights(cfg: ModelConfig, x: MicroShape, layers: int, head: bool) -> int:
    """Elements of the weights a chunk multiplies under autocast (each a bf16 copy the step keeps):
    the four projections of every layer and the head's (padded) rows; not biases, norms or embedding lookups."""
    per_layer = sum(rows * cols for rows, cols in block_linears(cfg, x.tp).values())
    head_rows = padded_vocab(cfg, x.tp) // x.tp if head else 0  # the head multiplies every (padded) row
    return layers * per_layer + head_rows * cfg.d_model
