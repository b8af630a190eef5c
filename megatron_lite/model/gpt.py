"""A decoder-only GPT in two flavours, chosen by ModelConfig fields, written as single-device code.

GPT-2 style: LayerNorm, GeLU (tanh), learned positions, biases, tied embeddings.
Llama style: RMSNorm, SwiGLU, RoPE (rotate-half convention, as HF Llama), no biases, GQA via n_kv_heads.

Every projection is an `nn.Linear` (a subclass that can leave out its bias) with a stable name (`attn.qkv`, `attn.proj`, `mlp.fc_in`, `mlp.fc_out`)
so that a table-driven parallelize step can swap them for tensor-parallel layers without touching this file.
Fused layouts, which sharding must respect:
  attn.qkv.weight rows = [q (n_heads*hd) | k (n_kv*hd) | v (n_kv*hd)]
  mlp.fc_in.weight rows = [gate (ffn) | up (ffn)] for SwiGLU, [fc (ffn)] for GeLU
The embedding has `padded_vocab` rows (a GEMM-friendly multiple); logits are computed for the true
vocabulary only, so padded rows never receive probability mass.
Norms, RoPE, the MLP activation and the loss go through `kernels.ops`, which runs the torch code or a
fused Triton kernel (`set_kernels`); `set_recompute` picks activation recomputation.

Left out on purpose: KV cache / generation, attention masks other than causal, MoE.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import ops
from megatron_lite.config import ModelConfig
from megatron_lite.parallel.random import TPRNGTracker, recompute


def padded_vocab_size(cfg: ModelConfig, tp: int = 1) -> int:
    multiple = cfg.vocab_multiple * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


class RMSNorm(nn.Module):
    kernel_backend = "torch"  # `kernels.backend`, set by GPT.set_kernels

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.kernel_backend)


class LayerNorm(nn.LayerNorm):
    kernel_backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps, self.kernel_backend)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class Linear(nn.Linear):
    """nn.Linear that can leave its bias out, for a kernel that fuses the bias add (GeLU)."""

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if add_bias else None)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim), halves repeated (HF Llama's rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # (s, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """x: (b, heads, s, hd); rotate pairs (i, i + hd/2) by the position angle (kernels/rope.py)."""
    return ops.apply_rope(x, cos, sin, backend)


class Attention(nn.Module):
    kernel_backend = "torch"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=cfg.bias)
        self.proj = Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.rope = cfg.position == "rope"
        # The per-TP-rank stream for attention-probability dropout (heads are split over TP); set by parallelize.
        self.tp_rng: TPRNGTracker | None = None
        self.recompute_core = False  # train.recompute=selective: keep q, k, v; redo softmax(qk^T) v in backward

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.qkv(x)  # (b, s, qkv_dim); s is the full sequence even when x holds a sequence-parallel shard
        b, s, _ = qkv.shape
        # The local head counts follow the weight shape, so a tensor-parallel shard runs this code unchanged.
        kv_dim = self.qkv.weight.shape[0] * self.n_kv_heads // (self.n_heads + 2 * self.n_kv_heads)
        q, k, v = qkv.split([self.qkv.weight.shape[0] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, hd)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, hd)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin, self.kernel_backend), apply_rope(k, cos, sin, self.kernel_backend)
        if self.recompute_core and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, tracker=self.tp_rng)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v with causal mask and dropout: (b, heads, s, hd) for q, k, v (GQA: fewer
        k/v heads). The memory-heavy, FLOP-light part that selective recomputation drops (Korthikanti 2022)."""
        dropout = self.dropout if self.training else 0.0
        with self.tp_rng.fork() if self.tp_rng is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                  enable_gqa=q.shape[1] != k.shape[1])


class MLP(nn.Module):
    kernel_backend = "torch"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.fc_in = Linear(cfg.d_model, cfg.ffn * (2 if self.swiglu else 1), bias=cfg.bias)
        self.fc_out = Linear(cfg.ffn, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = ops.swiglu(self.fc_in(x), self.kernel_backend)  # (b, s, 2f) = [gate | up] -> (b, s, f)
        elif self.kernel_backend == "triton":  # the fc_in bias is added inside the GeLU kernel
            h = ops.bias_gelu(self.fc_in(x, add_bias=False), self.fc_in.bias, self.kernel_backend)
        else:
            h = ops.bias_gelu(self.fc_in(x), None, self.kernel_backend)
        return self.fc_out(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope))
        return x + self.drop(self.mlp(self.norm2(x)))


class LMHead(nn.Module):
    """Logits over the true vocabulary (padded rows never scored); mean fp32 cross entropy given labels."""

    kernel_backend = "torch"

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = F.linear(h, weight[: self.vocab_size])  # (b, s, vocab)
        if labels is None:
            return logits
        return ops.cross_entropy(logits.flatten(0, 1), labels.flatten(), None, self.kernel_backend).mean()


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.padded_vocab = padded_vocab_size(cfg, tp)
        self.wte = nn.Embedding(self.padded_vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.to_blocks = nn.Identity()  # where sequence parallelism scatters the sequence over TP ranks
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = make_norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, self.padded_vocab, bias=False)
        self.head = LMHead(cfg.vocab_size)
        self.tp_rng: TPRNGTracker | None = None  # replayed with the default stream when blocks are recomputed
        self.recomputed_blocks: frozenset[int] = frozenset()
        if cfg.position == "rope":
            cos, sin = rope_cos_sin(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm weights are ones, biases zeros
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith(("attn.proj.weight", "mlp.fc_out.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def head_weight(self) -> torch.Tensor:
        """The output projection: the (tied) embedding or lm_head weight, padded rows included."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) -> final-normed hidden states (b, s, h)."""
        s = tokens.shape[1]
        x = self.wte(tokens)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=tokens.device))
        else:
            rope = (self.rope_cos[:s], self.rope_sin[:s])
        x = self.drop(self.to_blocks(x))
        for i, block in enumerate(self.blocks):
            if i in self.recomputed_blocks and torch.is_grad_enabled():
                x = recompute(block, x, rope, tracker=self.tp_rng)
            else:
                x = block(x, rope)
        return self.norm_f(x)

    def set_kernels(self, backend: str) -> None:
        """kernels.backend after resolution: `torch` (references) or `triton` (fused kernels) in every module
        that has a fused alternative (norms, RoPE, SwiGLU / bias-GeLU, cross entropy), sharded ones included."""
        assert backend in ops.BACKENDS, backend
        for module in self.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = backend

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """train.recompute: `full` keeps only the input of blocks 0, every, 2*every, ... and reruns each such
        block in backward; `selective` reruns every block's attention core; `none` keeps everything."""
        assert mode in ("none", "selective", "full") and every >= 1, (mode, every)
        self.recomputed_blocks = frozenset(range(0, len(self.blocks), every)) if mode == "full" else frozenset()
        for block in self.blocks:
            block.attn.recompute_core = mode == "selective"

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, vocab) without labels; mean next-token cross entropy (fp32) with labels."""
        return self.head(self.hidden_states(tokens), self.head_weight(), labels)
