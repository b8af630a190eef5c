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

A pipeline rank builds the same class holding only its chunks (`chunks`, from megatron_lite.pipeline): the
blocks it holds keep their global names (`blocks.7` is `blocks.7` wherever it lives), the embedding sits with
the first virtual stage and the final norm + head with the last (a tied head keeps its own copy of `wte`).
`forward(x, labels, chunk=k)` runs chunk k: tokens in on the first virtual stage, the loss out on the last,
hidden states (b, s, h) — (b, s/tp, h) under SP — everywhere else.

Dropout masks are keyed, not drawn in turn: `forward(..., rng_key=(step, micro-batch))` extends to
(seed, step, micro-batch, layer, site) for each mask (parallel/random.py), so a chunk, a recomputed block or a
micro-batch run out of order draws exactly the masks of the single-device model.

Modules are created on the meta device and only then given values (`materialize`), each parameter drawn from a
generator keyed by (seed, its global name) (model/init.py): no rank ever allocates more than it keeps, and every
layout starts from the weights of the whole model with the same seed. Padded embedding rows start at zero.

With data.document_mask a forward also gets the micro-batch's documents (model/documents.py): attention stays
inside each document, positions count from each document's start, and the loss is summed over the labels
predicted and divided by the count the whole step normalises by.

Left out on purpose: KV cache / generation, attention masks other than causal and per-document, MoE.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.kernels import OPS, ops
from megatron_lite.model.documents import DocumentMask, reduce_loss, varlen_applies, varlen_attention
from megatron_lite.model.init import check_full_weights, init_tensor, local_part, materialize, parameter_slots
from megatron_lite.model.positions import Rope, WholeSequence, apply_rope, rope_cos_sin
from megatron_lite.parallel import weight_grad
from megatron_lite.parallel.context_parallel import document_mask
from megatron_lite.parallel.fp8 import Float8Matmul, converts
from megatron_lite.parallel.random import EMBED_LAYER, Key, KeyedDropout, cp_key, keyed_default_rng, recompute
from megatron_lite.pipeline.partition import ChunkSpec


def padded_vocab_size(cfg: ModelConfig, tp: int = 1) -> int:
    multiple = cfg.vocab_multiple * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


class RMSNorm(nn.Module):
    kernel_op = "rmsnorm"  # which of kernels.OPS this module runs
    kernel_backend = "torch"  # `kernels.backend` for that op, set by GPT.set_kernels

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, weight_grad.held(self.weight), self.eps, self.kernel_backend)


class LayerNorm(nn.LayerNorm):
    kernel_op = "layernorm"
    kernel_backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(
            x, weight_grad.held(self.weight), weight_grad.held(self.bias), self.eps, self.kernel_backend
        )


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose lookup can use a stand-in weight (a pipeline's tied copy, see model/tied.py)."""

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return weight_grad.embedding(tokens, self.weight if weight is None else weight)


class Linear(nn.Linear):
    """nn.Linear that can leave its bias out, for a kernel that fuses the bias add (GeLU). fp8: its float8
    matmul under train.fp8 (GPT.set_fp8), else None."""

    fp8 = None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        return weight_grad.linear(x, self.weight, self.bias if add_bias else None, self.fp8)


class Attention(nn.Module):
    kernel_op = "rope"
    kernel_backend = "torch"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=cfg.bias)
        self.proj = Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.rope = cfg.position == "rope"
        # This rank's TP rank when heads are split over TP (set by parallelize): part of the attention-dropout key.
        self.tp_rank: int | None = None
        # Context parallelism (model/parallelize_cp.py): ring or Ulysses attention around `sdpa`, and this
        # rank's cp rank where the attention core holds a cp-split part (Ulysses: a share of the heads).
        self.cp_attention: Callable | None = None
        self.cp_rank: int | None = None
        self.recompute_core = False  # train.recompute=selective: keep q, k, v; redo softmax(qk^T) v in backward

    def forward(self, x: torch.Tensor, rope: Rope | None, key: Key, docs: DocumentMask | None = None) -> torch.Tensor:
        """key: (seed, step, micro-batch, layer), completed with the site for the attention-dropout mask; docs:
        the micro-batch's documents (data.document_mask), None for plain causal attention."""
        qkv = self.qkv(x)  # (b, s, qkv_dim); s is the full sequence even when x holds a sequence-parallel shard
        b, s, _ = qkv.shape
        # The local head counts follow the weight shape, so a tensor-parallel shard runs this code unchanged.
        kv_dim = self.qkv.weight.shape[0] * self.n_kv_heads // (self.n_heads + 2 * self.n_kv_heads)
        q, k, v = qkv.split([self.qkv.weight.shape[0] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, hd)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, hd)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if rope is not None and docs is not None:  # each token's row: its position in its document
            q, k = (apply_rope(t, rope.cos, rope.sin, self.kernel_backend, docs.positions) for t in (q, k))
        elif rope is not None:
            cos, sin = rope.at(s)  # the rows of this rank's positions
            q, k = apply_rope(q, cos, sin, self.kernel_backend), apply_rope(k, cos, sin, self.kernel_backend)
        if self.recompute_core and torch.is_grad_enabled():
            y = recompute(self.core, q, k, v, key, docs)
        else:
            y = self.core(q, k, v, key, docs)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: Key, docs=None) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v with causal mask and dropout: (b, heads, s, hd) for q, k, v (GQA: fewer
        k/v heads). The memory-heavy, FLOP-light part that selective recomputation drops (Korthikanti 2022).
        Under context parallelism s is this rank's share and the causal mask is over global positions."""
        if self.cp_attention is not None:
            return self.cp_attention(self, q, k, v, key, docs)
        return self.sdpa(q, k, v, key, docs)

    def sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: Key, docs: DocumentMask | None = None
    ) -> torch.Tensor:
        """Causal attention over a whole sequence in order, by torch's SDPA (flash attention on a GPU); given docs,
        within each document: on CUDA without dropout by FlashAttention's variable-length kernel, else by SDPA with
        a block-diagonal causal mask (model/documents.py). SDPA draws its dropout from the default generator, which
        is seeded from the key for the call."""
        gqa = q.shape[1] != k.shape[1]
        dropout = self.dropout if self.training else 0.0
        if docs is not None and dropout == 0.0 and varlen_applies(q):
            return varlen_attention(q, k, v, docs)
        mask = None if docs is None else document_mask(docs.segments, docs.segments)
        causal = mask is None
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        with keyed_default_rng(cp_key((*key, "attn_probs"), self.cp_rank), self.tp_rank, q.device):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout, enable_gqa=gqa
            )


class MLP(nn.Module):
    kernel_backend = "torch"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.kernel_op = "swiglu" if self.swiglu else "bias_gelu"
        self.fc_in = Linear(cfg.d_model, cfg.ffn * (2 if self.swiglu else 1), bias=cfg.bias)
        self.fc_out = Linear(cfg.ffn, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = ops.swiglu(self.fc_in(x), self.kernel_backend)  # (b, s, 2f) = [gate | up] -> (b, s, f)
        elif self.kernel_backend == "triton":  # the fc_in bias is added inside the GeLU kernel
            h = ops.bias_gelu(self.fc_in(x, add_bias=False), weight_grad.held(self.fc_in.bias), self.kernel_backend)
        else:
            h = ops.bias_gelu(self.fc_in(x), None, self.kernel_backend)
        return self.fc_out(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer  # global index: part of every dropout key of this block
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg)
        self.drop = KeyedDropout(cfg.dropout)  # both residual branches, told apart by the site in the key

    def forward(
        self, x: torch.Tensor, rope=None, key: Key = (0, 0, 0), docs: DocumentMask | None = None
    ) -> torch.Tensor:
        """key: (seed, step, micro-batch), see parallel/random.py; docs: data.document_mask's documents."""
        return self.compute(x, rope, (*key, self.layer), docs)

    def compute(self, x: torch.Tensor, rope, key: Key, docs: DocumentMask | None = None) -> torch.Tensor:
        """The block itself; key already holds the layer. What train.compile compiles (GPT.compile_blocks): it
        reads no integer attribute of the block, which torch.compile would take as a constant, so every block
        shares one compiled graph instead of compiling once per layer index."""
        x = x + self.drop(self.attn(self.norm1(x), rope, key, docs), (*key, "attn_out"))
        return x + self.drop(self.mlp(self.norm2(x)), (*key, "mlp_out"))


class LayerStack(nn.ModuleDict):
    """Blocks keyed by their global layer index, so parameter names stay `blocks.<i>` on whichever pipeline
    rank holds them. Indexing takes the global index; iteration yields the blocks in layer order."""

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self.values())

    def indices(self) -> list[int]:
        return [int(k) for k in self.keys()]


class LMHead(nn.Module):
    """Logits over the true vocabulary (padded rows never scored); mean fp32 cross entropy given labels."""

    kernel_op = "cross_entropy"
    kernel_backend = "torch"

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
    ) -> torch.Tensor:
        # The GEMM runs over every (padded) row: with 50,257 columns the logits' leading dimension is odd and
        # cuBLAS falls back to kernels that took gpt-1.3b's head 5x its FLOP time on an H100. The padded
        # columns are then dropped by view: the loss and the returned logits see the true vocabulary only.
        # Under a zero-bubble schedule the weight gradient is made in B: W would hold the logits' gradient,
        # (b, s, vocab), per micro-batch; held, it costs the weight's size (parallel/weight_grad.py).
        logits = weight_grad.head_linear(h, weight)  # (b, s, padded vocab)
        if labels is None:
            return logits[..., : self.vocab_size]
        losses = ops.cross_entropy(logits.flatten(0, 1), labels.flatten(), self.vocab_size, self.kernel_backend)
        return reduce_loss(losses, docs)


class GPT(nn.Module):
    TIED_WEIGHT = -1  # forward(None, chunk=TIED_WEIGHT): the tied embedding weight as an output (model/tied.py)

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, seed: int = 0, device: torch.device | str | None = None):
        """Build on the meta device (no memory, no random draws), then materialise on `device` (CPU by default)
        with the keyed init of model/init.py. device="meta" leaves that to `materialize`, after keep_chunks and
        parallelize have cut the model to what this rank holds (model/build.py)."""
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.padded_vocab = padded_vocab_size(cfg, tp)
        with torch.device("meta"):
            self.wte = Embedding(self.padded_vocab, cfg.d_model)
            self.wpe = Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
            self.drop = KeyedDropout(cfg.dropout)
            self.to_blocks = nn.Identity()  # where sequence parallelism scatters the sequence over TP ranks
            self.blocks = LayerStack({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
            self.norm_f = make_norm(cfg)
            self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, self.padded_vocab, bias=False)
            self.head = LMHead(cfg.vocab_size)
            if cfg.position == "rope":  # values come with materialize()
                self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)
                self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)
        self.sequence = WholeSequence()  # how this rank holds each sequence (context parallelism: a shard)
        self.recomputed_blocks: frozenset[int] = frozenset()
        self.tied = None  # model/tied.TiedEmbedding when a pipeline splits the tied embedding over two stages
        # The whole model is one chunk until keep_chunks() cuts it down to a pipeline rank's share.
        self.chunks = [
            ChunkSpec(chunk=0, virtual_stage=0, layers=range(cfg.n_layers), has_embedding=True, has_head=True)
        ]
        # Global name -> shape of every parameter of the whole serial model: what the keyed init draws, whatever
        # part of it this model keeps.
        self.full_shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.materialize(device)

    def keep_chunks(self, chunks: list[ChunkSpec]) -> GPT:
        """Drop every module this pipeline rank does not run: blocks of other stages, the embedding without the
        first virtual stage (its tied copy stays with the head), the final norm and head without the last."""
        self.chunks = list(chunks)
        held = {i for spec in chunks for i in spec.layers}
        for i in self.blocks.indices():
            if i not in held:
                del self.blocks[str(i)]
        first, last = any(c.has_embedding for c in chunks), any(c.has_head for c in chunks)
        if not first:
            self.wpe = None
            if not (last and self.lm_head is None):
                self.wte = None
        if not last:
            self.norm_f, self.lm_head = None, None
        return self

    def _full_init(self, name: str) -> torch.Tensor:
        return init_tensor(name, self.full_shapes[name], self.cfg, self.seed)

    def materialize(
        self,
        device: torch.device | str | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        weights: Mapping[str, torch.Tensor] | None = None,
        partition: Callable[[nn.Parameter], None] | None = None,
    ) -> GPT:
        """Give every parameter still on the meta device its value on `device`: the full tensor (the keyed init,
        or weights[name] from a full state dict, which must fit the whole model) and then this rank's part of
        it, one parameter at a time. partition(param) runs on each new parameter (ZeRO-3). Buffers follow."""
        device = torch.device(device if device is not None else "cpu")
        if weights is not None:
            check_full_weights(weights, self.full_shapes)
        # A copy of each checkpoint tensor: the parameter must not share memory with the caller's dict.
        from_weights = lambda name: weights[name].clone(memory_format=torch.contiguous_format)  # noqa: E731
        materialize(self, from_weights if weights is not None else self._full_init, device, dtype, partition)
        if self.cfg.position == "rope":  # computed on CPU, as before, so every device gets the same bits
            cos, sin = rope_cos_sin(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw every parameter in place with the keyed init (model/init.py): GPT-2's rules, each full tensor
        from a generator seeded by (self.seed, its name), then cut to what this model holds (chunks, TP shards)."""
        for name, module, attr in parameter_slots(self):
            module._parameters[attr].copy_(local_part(module, attr, self._full_init(name)))

    def embedding_weight(self) -> torch.Tensor:
        """wte.weight, or, when a pipeline holds the tied embedding on two stages, a stand-in whose gradient is
        summed over both stages before DeepSpeed sees it (model/tied.py)."""
        return self.wte.weight if self.tied is None else self.tied.stand_in()

    def tied_weight_output(self) -> torch.Tensor:
        """The tied embedding weight as a graph output, for the backward that hands it both stages' gradient
        (model/tied.py). Reached as forward(None, chunk=TIED_WEIGHT): DeepSpeed's hooks open and close a
        backward only around its engine's forward, which calls forward and nothing else."""
        return self.wte.weight * 1.0

    def head_weight(self) -> torch.Tensor:
        """The output projection: the (tied) embedding or lm_head weight, padded rows included."""
        return self.embedding_weight() if self.lm_head is None else self.lm_head.weight

    def dropout_key(self, rng_key: tuple[int, int] | None) -> Key:
        """(step, micro-batch index in the global batch) -> (seed, step, micro-batch); None means (0, 0)."""
        step, microbatch = rng_key if rng_key is not None else (0, 0)
        return (self.seed, int(step), int(microbatch))

    def embed(self, tokens: torch.Tensor, key: Key, docs: DocumentMask | None = None) -> torch.Tensor:
        """tokens (b, s) -> the first block's input (b, s, h), or (b, s/tp, h) under sequence parallelism."""
        x = self.wte(tokens, self.embedding_weight())
        if self.wpe is not None:
            positions = self.sequence.positions(tokens.shape[1], tokens.device) if docs is None else docs.positions
            x = x + self.wpe(positions)
        return self.drop(self.to_blocks(x), (*key, EMBED_LAYER, "embed"))

    def run_blocks(self, x: torch.Tensor, layers: range, key: Key, docs: DocumentMask | None = None) -> torch.Tensor:
        rope = Rope(self.rope_cos, self.rope_sin, self.sequence) if self.cfg.position == "rope" else None
        for i in layers:
            block = self.blocks[i]
            if i in self.recomputed_blocks and torch.is_grad_enabled():
                x = recompute(block, x, rope, key, docs)  # the rerun gets the key and documents: the same masks
            else:
                x = block(x, rope, key, docs)
        return x

    def hidden_states(self, tokens: torch.Tensor, rng_key: tuple[int, int] | None = None) -> torch.Tensor:
        """tokens (b, s) -> final-normed hidden states (b, s, h) of a whole (one-chunk) model."""
        key = self.dropout_key(rng_key)
        x = self.embed(self.sequence.shard(tokens), key)
        return self.norm_f(self.run_blocks(x, self.chunks[0].layers, key))

    def set_kernels(self, backend: str | Mapping[str, str]) -> None:
        """kernels.backend after resolution: `torch` (references) or `triton` (fused kernels), for every op or
        per op ({op: backend}, kernels.resolve_backend), in every module that has a fused alternative (norms,
        RoPE, SwiGLU / bias-GeLU, cross entropy), sharded ones included."""
        choice = dict.fromkeys(OPS, backend) if isinstance(backend, str) else dict(backend)
        assert set(choice.values()) <= set(ops.BACKENDS) and set(choice) == set(OPS), choice
        for module in self.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = choice[module.kernel_op]

    def compile_blocks(self) -> None:
        """train.compile: torch.compile each transformer block's body (Block.compute) in place: the module and
        its parameter names stay, so checkpoints, DeepSpeed's hooks and recompute see the same model. The
        blocks share one compiled graph: compiling whole blocks (nn.Module.compile) specialised on each block's
        layer index, recompiled per layer and, past torch's recompile limit of 8, ran the remaining layers
        uncompiled. The ops' functions are resolved first (kernels.ops.preload), so no import happens inside a
        traced block. Blocks with dropout break the graph at the keyed mask draws and still run correctly."""
        weight_grad.run_eagerly_under_compile()
        ops.preload({m.kernel_backend for m in self.modules() if hasattr(m, "kernel_backend")})
        for block in self.blocks.values():
            block.compute = torch.compile(block.compute)

    def set_fp8(self, recipe: str, device_type: str) -> list[str]:
        """train.fp8: the blocks' projections (attn.qkv, attn.proj, mlp.fc_in, mlp.fc_out, TP shards included)
        multiply in float8 through torchao (parallel/fp8.py); `none` turns it off. The embedding and the LM head
        stay in high precision, as torchtitan and Megatron-LM leave them, and so does a projection whose local
        weight has a dimension that is not a multiple of 16 (torch._scaled_mm's alignment). Parameters and
        their names do not change, so checkpoints load with fp8 on or off. Returns the converted names."""
        fp8 = None if recipe == "none" else Float8Matmul.of(recipe, device_type)
        converted = []
        for name, module in self.blocks.named_modules(prefix="blocks"):
            if "fp8" not in type(module).__dict__:
                continue
            shape = getattr(module.weight, "ds_shape", module.weight.shape)  # ZeRO-3: the whole local shard
            module.fp8 = fp8 if fp8 is not None and converts(shape[1], shape[0]) else None
            if module.fp8 is not None:
                converted.append(name)
        return converted

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """train.recompute: `full` keeps only the input of blocks 0, every, 2*every, ... (global layer indices,
        wherever the pipeline put them) and reruns each such block in backward; `selective` reruns every block's
        attention core; `none` keeps everything."""
        assert mode in ("none", "selective", "full") and every >= 1, (mode, every)
        self.recomputed_blocks = frozenset(range(0, self.cfg.n_layers, every)) if mode == "full" else frozenset()
        for block in self.blocks:
            block.attn.recompute_core = mode == "selective"

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        chunk: int = 0,
        rng_key: tuple[int, int] | None = None,
        documents=None,
    ) -> torch.Tensor:
        """Run chunk `chunk` (the whole model unless cut by keep_chunks). inputs: tokens (b, s) on the first
        virtual stage, else the previous stage's hidden states. rng_key: (step, micro-batch index in the global
        batch), which with the seed, layer and site keys every dropout mask (None: (0, 0)). Returns the mean
        next-token cross entropy (fp32) when the chunk holds the head and labels are given, logits
        (b, s, vocab) without labels, else hidden states for the next stage.

        Under context parallelism tokens and labels are whole sequences, of which this rank keeps its shard;
        hidden states and logits are this rank's shard, and the loss is this rank's share of the sequence's
        mean: the sum over the cp ranks is the loss (every rank holds as many tokens).

        documents (data.document_mask): the micro-batch's data.documents.Windows; attention stays within them, positions
        count from their starts, and the loss is this rank's sum over the labels predicted / documents.loss_tokens.

        Two chunk indices are not chunks: TIED_WEIGHT returns the tied embedding weight (model/tied.py) and
        weight_grad.WEIGHT_GRADS the weight-gradient work a zero-bubble schedule's W releases, each as a graph
        output for the caller's backward (parallel/weight_grad.py)."""
        if chunk == self.TIED_WEIGHT:
            return self.tied_weight_output()
        if chunk == weight_grad.WEIGHT_GRADS:  # a zero-bubble schedule's W step (parallel/weight_grad.py)
            return weight_grad.released_output()
        spec = self.chunks[chunk]
        key = self.dropout_key(rng_key)
        docs = None if documents is None else DocumentMask.of(documents)  # from data.documents.Windows
        if docs is not None and self.sequence.size > 1:
            docs = docs.local(self.sequence.shard)
        x = self.embed(self.sequence.shard(inputs), key, docs) if spec.has_embedding else inputs
        x = self.run_blocks(x, spec.layers, key, docs)
        if not spec.has_head:
            return x
        if labels is None:
            return self.head(self.norm_f(x), self.head_weight())
        loss = self.head(self.norm_f(x), self.head_weight(), self.sequence.shard(labels), docs)
        return loss / self.sequence.size if self.sequence.size > 1 and docs is None else loss
