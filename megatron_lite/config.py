"""The configuration schema: Hydra structured configs, one dataclass per group.

YAML files under `configs/` hold presets only (model shapes); every key a user can override is a field
here, with its meaning in the docstring line beneath it. `validate(cfg, world_size)` checks everything that
can be checked before a process group or a model exists and raises `ConfigError` with one line that names
the key as typed, the value, why it is wrong and a fix.

Left out on purpose: expert parallelism (no config keys until it exists).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from megatron_lite.errors import ConfigError
from megatron_lite.pipeline.partition import layers_per_stage
from megatron_lite.pipeline.schedules import SCHEDULE_CHOICES, SPLIT_BACKWARD, resolve_schedule

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_PRESETS = ("tiny", "gpt2-124m", "gpt2-350m", "gpt-1.3b", "llama-7b", "llama-tiny")


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset name, for logs and checkpoints."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head attention)."""
    d_model: int = 128
    """Hidden size."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; None means 4 * d_model."""
    vocab_size: int = 8192
    """Tokenizer vocabulary; the embedding is padded up to a multiple of `vocab_multiple` * tp."""
    vocab_multiple: int = 64
    """Embedding rows are padded to a multiple of this times tp (GEMM-friendly shapes); padded rows never get logits."""
    seq_len: int = 128
    """Training context length in tokens."""
    norm: str = "layernorm"
    """layernorm (GPT-2) or rmsnorm (Llama)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: str = "gelu"
    """gelu (GPT-2, tanh approximation) or swiglu (Llama)."""
    position: str = "learned"
    """learned absolute positions (GPT-2) or rope (Llama)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (position=rope only)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    bias: bool = True
    """Biases in linears and norms (GPT-2 style); False for Llama style."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    init_std: float = 0.02
    """Std of the normal initialisation; residual output projections use init_std / sqrt(2 * n_layers)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (ranks sharing each layer's weights)."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved 1F1B when > 1)."""
    sp: bool = False
    """Sequence parallelism alongside tensor parallelism."""
    schedule: str = "auto"
    """Pipeline schedule: auto (interleaved when vpp > 1, else 1f1b), gpipe, 1f1b, interleaved, zb_h1 (zero
    bubble: weight gradients delayed into 1F1B's idle slots, about a third of its bubble at the same memory) or
    zbv (vpp=2 in a V, about a sixth)."""
    pp_layers: Optional[list[int]] = None
    """Layers per virtual stage (pp * vpp entries, in virtual-stage order); None splits model.n_layers evenly."""
    cp: int = 1
    """Context-parallel size: each sequence is split over this many ranks (long contexts); dp = world / (tp*cp*pp)."""
    cp_mode: str = "ring"
    """Context-parallel attention: ring (K/V blocks passed around the cp ranks) or ulysses (all-to-all that swaps
    sequence shards for head shards; needs cp to divide the heads and KV heads per TP rank)."""


@dataclass
class ZeroConfig:
    stage: int = 0
    """DeepSpeed ZeRO stage: 0 (DDP-like), 1 (optimizer states), 2 (+gradients), 3 (+parameters)."""
    offload_optimizer: str = "none"
    """Where optimizer states live: none, cpu or nvme (needs stage >= 1)."""
    offload_param: str = "none"
    """Where parameters live between uses: none, cpu or nvme (needs stage 3)."""
    nvme_path: str = "/tmp/megatron_lite_nvme"
    """Directory used for nvme offload."""


@dataclass
class TrainConfig:
    steps: int = 500
    """Optimizer steps to train for."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks: micro * accumulation * dp."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU), fp32 or bf16."""
    recompute: str = "none"
    """Activation recomputation: none, selective (the attention core of every layer) or full (whole layers)."""
    recompute_every: int = 1
    """With recompute=full: recompute layers 0, k, 2k, ... (1 = every layer; larger trades memory for speed)."""
    max_skipped_in_row: int = 5
    """Stop (without saving) after this many consecutive steps with a non-finite loss or gradient norm, each of
    which skips its update on every rank; 0 never stops."""
    compile: bool = False
    """torch.compile each transformer block (GPU fusion next to our kernels); not with zero.stage=3."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    eval_interval: int = 100
    """Validation loss every N steps on the held-out split (0 = never)."""
    eval_iters: int = 4
    """Micro-batches per validation pass."""
    log_interval: int = 1
    """Console progress-line update every N steps (metrics.jsonl always gets every step)."""
    track_memory: bool = False
    """On a CPU, measure every rank's peak live tensor bytes per step (mem_peak_gib) with a dispatch-mode tracker;
    it costs a Python call per operator. GPUs always report mem_peak_gib (the CUDA allocator counts it)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many steps."""
    decay: str = "cosine"
    """Decay after warmup until train.steps: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not on biases or norm gains)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""


@dataclass
class DataConfig:
    path: str = "data/shakespeare-8k"
    """Directory written by tools/prepare_data.py (train.bin, val.bin, meta.json); relative to the repo."""
    tokenizer: str = "assets/tokenizers/shakespeare-8k"
    """Local HF tokenizer directory used by prepare_data (the prepared data records which one it used)."""


@dataclass
class CheckpointConfig:
    dir: str = "${run.dir}/checkpoints"
    """Where step_<NNNNNNN>/ directories and the `latest` pointer live."""
    interval: int = 250
    """Save every N steps (0 = only at the end and on a stop signal)."""
    keep: int = 3
    """Complete checkpoints to keep (older ones are deleted after a new one commits); 0 keeps all."""
    resume: str = "auto"
    """auto (latest if present), never, or a path to a step_<N> directory."""
    async_save: bool = False
    """Stage each save in host memory and write it from a background thread (`async` is a Python keyword)."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Where this run writes metrics.jsonl, wandb files and (by default) checkpoints."""
    name: Optional[str] = None
    """Run name for wandb; defaults to the last part of run.dir."""


@dataclass
class WandbConfig:
    mode: str = "auto"
    """auto (online with WANDB_API_KEY, else offline), offline, online or disabled."""
    project: str = "megatron_lite"
    """wandb project name."""
    entity: Optional[str] = None
    """wandb entity (team); None uses the default."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DistConfig:
    timeout_s: int = 600
    """Collective timeout (s) from start-up through the first step, and around checkpoint writes: rendezvous,
    group creation, resume, the first step's warm-up and every save wait this long for the slowest rank."""
    step_timeout_s: int = 300
    """Collective timeout (s) between the first step and the end: a dead or hung rank ends the job this soon
    (then torchrun or Slurm restarts it). Keep it above the slowest step plus its evaluation."""


@dataclass
class KernelsConfig:
    backend: str = "auto"
    """auto (torch until the Triton kernels are verified on a GPU), triton (TRITON_INTERPRET=1 on CPU) or torch."""


@dataclass
class ClusterConfig:
    """The machines a layout is planned for (`train.py --check` / `--plan`; megatron_lite/plan/hardware.py)."""

    gpu: str = "auto"
    """a100-40gb, a100-80gb, h100-sxm, h200, b200, or auto (this machine's GPU if the table knows it, else h100-sxm)."""
    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism stays within a node."""
    nodes: Optional[int] = None
    """Nodes; None: as many as WORLD_SIZE needs for --check, 1 for --plan."""
    intra_node_GBps: Optional[float] = None
    """Bus bandwidth between GPUs of a node, GB/s per direction; None: the GPU's NVLink."""
    inter_node_GBps: Optional[float] = None
    """A node's network bandwidth, all NICs together, GB/s; None: that of the GPU's DGX/HGX node (8 NICs)."""
    achievable: float = 0.65
    """Fraction of the bf16 dense peak that GEMMs and attention sustain (an assumption; see docs/performance.md
    'Choosing a layout')."""
    reserve_gib: float = 2.0
    """Memory per GPU that tensors cannot use: CUDA context, NCCL buffers, allocator fragmentation."""


@dataclass
class Config:
    model: ModelConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 1234
    """Seed of weights, data order and dropout."""


def _fail(key: str, value, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value} {why}; {fix}")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        _fail(key, value, "is not a valid choice", f"use one of {', '.join(map(str, allowed))}")


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def repo_path(path: str) -> str:
    """Resolve a data/tokenizer path: absolute as given, else relative to the repo root."""
    return path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)


def validate(cfg: Config, world_size: int) -> None:
    """Check cfg for this world size; raise ConfigError with a one-line explanation on the first problem."""
    m, p, z, t, o = cfg.model, cfg.parallel, cfg.zero, cfg.train, cfg.optim

    # --- model shape ---
    for key in ("n_layers", "n_heads", "d_model", "vocab_size", "seq_len"):
        if getattr(m, key) <= 0:
            _fail(f"model.{key}", getattr(m, key), "must be positive", "pick a positive integer")
    if m.d_model % m.n_heads:
        _fail("model.n_heads", m.n_heads, f"must divide model.d_model={m.d_model}",
              f"try {_divisors(m.d_model)}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        _fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}",
              f"try {_divisors(m.n_heads)}")
    if m.ffn_hidden is not None and m.ffn_hidden <= 0:
        _fail("model.ffn_hidden", m.ffn_hidden, "must be positive", "pick a positive integer or null for 4*d_model")
    _choice("model.norm", m.norm, ("layernorm", "rmsnorm"))
    _choice("model.activation", m.activation, ("gelu", "swiglu"))
    _choice("model.position", m.position, ("learned", "rope"))
    if m.position == "rope" and m.head_dim % 2:
        _fail("model.position", m.position, f"needs an even head dim, got {m.head_dim}",
              "change model.d_model or model.n_heads")
    if not 0.0 <= m.dropout < 1.0:
        _fail("model.dropout", m.dropout, "must be in [0, 1)", "use e.g. 0.0 or 0.1")

    # --- parallel layout ---
    for key in ("tp", "pp", "vpp", "cp"):
        if getattr(p, key) < 1:
            _fail(f"parallel.{key}", getattr(p, key), "must be >= 1", "use 1 to disable")
    if world_size % (p.tp * p.cp * p.pp):
        key, val = ("parallel.cp", p.cp) if p.cp > 1 else ("parallel.tp", p.tp)
        _fail(key, val, f"makes tp*cp*pp={p.tp * p.cp * p.pp} (tp={p.tp}, cp={p.cp}, pp={p.pp}), which must divide the "
              f"world size {world_size}", f"pick tp*cp*pp among {_divisors(world_size)}")
    for key, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads), ("model.ffn_hidden", m.ffn)):
        if val % p.tp:
            # KV heads are split, never replicated, so tp must divide them too (see model/parallelize.py).
            _fail("parallel.tp", p.tp, f"must divide {key}={val}", f"try {_divisors(val)}")
    if p.sp and m.seq_len % p.tp:
        _fail("parallel.sp", p.sp, f"needs parallel.tp={p.tp} to divide model.seq_len={m.seq_len}",
              "change model.seq_len or parallel.tp")
    _validate_context_parallel(cfg)
    _validate_cluster(cfg.cluster)
    dp = world_size // (p.tp * p.cp * p.pp)
    _validate_pipeline(cfg, dp)

    # --- ZeRO ---
    _choice("zero.stage", z.stage, (0, 1, 2, 3))
    _choice("zero.offload_optimizer", z.offload_optimizer, ("none", "cpu", "nvme"))
    _choice("zero.offload_param", z.offload_param, ("none", "cpu", "nvme"))
    if z.offload_optimizer != "none" and z.stage == 0:
        _fail("zero.offload_optimizer", z.offload_optimizer, "needs zero.stage >= 1",
              "set zero.stage=1, 2 or 3")
    if z.offload_param != "none" and z.stage != 3:
        _fail("zero.offload_param", z.offload_param, f"needs zero.stage=3 (got {z.stage})",
              "set zero.stage=3 or zero.offload_param=none")

    # --- batch and steps ---
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, key) <= 0:
            _fail(f"train.{key}", getattr(t, key), "must be positive", "pick a positive integer")
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of train.micro_batch_size={t.micro_batch_size} x dp={dp}",
              f"use {t.micro_batch_size * dp * max(1, t.global_batch_size // (t.micro_batch_size * dp))}"
              " or change train.micro_batch_size")
    _choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    _choice("train.recompute", t.recompute, ("none", "selective", "full"))
    if t.recompute_every < 1:
        _fail("train.recompute_every", t.recompute_every, "must be >= 1", "use 1 (every layer) or k (every k-th)")
    for key in ("timeout_s", "step_timeout_s"):
        if getattr(cfg.dist, key) < 1:
            _fail(f"dist.{key}", getattr(cfg.dist, key), "must be >= 1 (seconds)", "use e.g. 600 / 300")
    if t.max_skipped_in_row < 0:
        _fail("train.max_skipped_in_row", t.max_skipped_in_row, "must be >= 0", "use 5, or 0 to never stop")
    if t.compile and cfg.zero.stage == 3:
        _fail("train.compile", True, "does not work with zero.stage=3 (ZeRO-3 gathers and frees parameters in "
              "module hooks that a compiled block would trace through)", "use zero.stage=1 or 2, or train.compile=false")
    if t.grad_clip < 0:
        _fail("train.grad_clip", t.grad_clip, "must be >= 0", "use 1.0, or 0 to disable clipping")
    if t.eval_interval < 0 or t.eval_iters <= 0:
        key, val = ("train.eval_interval", t.eval_interval) if t.eval_interval < 0 else ("train.eval_iters", t.eval_iters)
        _fail(key, val, "is out of range", "eval_interval >= 0 (0 = never), eval_iters >= 1")
    if t.log_interval <= 0:
        _fail("train.log_interval", t.log_interval, "must be positive", "use 1")

    # --- optimizer ---
    if not (o.lr > 0 and math.isfinite(o.lr)):
        _fail("optim.lr", o.lr, "must be a positive number", "use e.g. 3e-4")
    if o.min_lr < 0 or o.min_lr > o.lr:
        _fail("optim.min_lr", o.min_lr, f"must be in [0, optim.lr={o.lr}]", "use e.g. optim.lr / 10")
    if o.warmup_steps < 0:
        _fail("optim.warmup_steps", o.warmup_steps, "must be >= 0", "use e.g. 1% of train.steps")
    _choice("optim.decay", o.decay, ("cosine", "linear", "constant"))
    if o.weight_decay < 0:
        _fail("optim.weight_decay", o.weight_decay, "must be >= 0", "use e.g. 0.1")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        _fail("optim.betas", list(o.betas), "must be two numbers in [0, 1)", "use [0.9,0.95]")

    # --- data, checkpoints, logging ---
    data_dir = repo_path(cfg.data.path)
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        _fail("data.path", cfg.data.path, "has no prepared data (meta.json missing)",
              f"run `make data` or `python tools/prepare_data.py --tokenizer {cfg.data.tokenizer} --out {cfg.data.path}`")
    with open(os.path.join(data_dir, "meta.json")) as f:
        data_vocab = json.load(f).get("vocab_size", 0)
    if data_vocab > m.vocab_size:
        _fail("model.vocab_size", m.vocab_size, f"is smaller than data.path={cfg.data.path}'s tokenizer ({data_vocab} "
              "tokens)", f"use model.vocab_size>={data_vocab} or data prepared with a smaller tokenizer")
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.keep < 0:
        key = "checkpoint.interval" if cfg.checkpoint.interval < 0 else "checkpoint.keep"
        _fail(key, getattr(cfg.checkpoint, key.split(".")[1]), "must be >= 0", "use 0 to disable")
    r = cfg.checkpoint.resume
    if r not in ("auto", "never") and not os.path.isfile(os.path.join(r, "meta.json")):
        _fail("checkpoint.resume", r, "is not a complete checkpoint directory (no meta.json)",
              "use auto, never, or a path to a step_<N> directory")
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, ("auto", "offline", "online", "disabled"))
    _choice("kernels.backend", cfg.kernels.backend, ("auto", "triton", "torch"))
    if cfg.kernels.backend == "triton" and not _has_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
        _fail("kernels.backend", "triton", "needs a GPU, or Triton's CPU interpreter (slow; for tests)",
              "use kernels.backend=auto, or export TRITON_INTERPRET=1 before starting")


def _validate_context_parallel(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _choice("parallel.cp_mode", p.cp_mode, ("ring", "ulysses"))
    if p.cp == 1:
        return
    # The load-balanced causal split cuts the sequence into 2*cp equal chunks; SP then splits a rank's share over tp.
    chunks = 2 * p.cp * (p.tp if p.sp else 1)
    if m.seq_len % chunks:
        what = f"2*cp*tp={chunks} (with parallel.sp)" if p.sp and p.tp > 1 else f"2*cp={chunks}"
        fit = [c for c in range(1, m.seq_len + 1) if m.seq_len % (2 * c * (p.tp if p.sp else 1)) == 0]
        _fail("parallel.cp", p.cp, f"needs {what} to divide model.seq_len={m.seq_len} (each rank holds two of "
              "2*cp equal chunks)", f"use parallel.cp in {fit or [1]} or change model.seq_len")
    if p.cp_mode == "ulysses":
        for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads)):
            local = heads // p.tp
            if local % p.cp:
                fit = [c for c in range(1, local + 1) if (m.n_heads // p.tp) % c == 0 and (m.kv_heads // p.tp) % c == 0]
                _fail("parallel.cp", p.cp, f"with parallel.cp_mode=ulysses must divide the {key.split('.')[1]} per "
                      f"TP rank ({key}={heads} / parallel.tp={p.tp} = {local})",
                      f"use parallel.cp in {fit}, or parallel.cp_mode=ring (any head count)")
    if cfg.train.compile:
        _fail("train.compile", True, f"does not work with parallel.cp={p.cp} (the attention's ring or all-to-all "
              "would break every compiled block's graph)", "use train.compile=false or parallel.cp=1")


GPU_CHOICES = ("auto", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200")  # plan/hardware.py's table


def _validate_cluster(c: ClusterConfig) -> None:
    _choice("cluster.gpu", c.gpu, GPU_CHOICES)
    for key in ("gpus_per_node", "nodes"):
        value = getattr(c, key)
        if value is not None and value < 1:
            _fail(f"cluster.{key}", value, "must be >= 1", "e.g. cluster.gpus_per_node=8 cluster.nodes=4")
    for key in ("intra_node_GBps", "inter_node_GBps"):
        value = getattr(c, key)
        if value is not None and not value > 0:
            _fail(f"cluster.{key}", value, "must be a positive bandwidth in GB/s", "e.g. 450, or null for the GPU's default")
    if not 0 < c.achievable <= 1:
        _fail("cluster.achievable", c.achievable, "must be a fraction in (0, 1]", "e.g. 0.65")
    if c.reserve_gib < 0:
        _fail("cluster.reserve_gib", c.reserve_gib, "must be >= 0", "e.g. 2")


def _validate_pipeline(cfg: Config, dp: int) -> None:
    m, p, z, t = cfg.model, cfg.parallel, cfg.zero, cfg.train
    _choice("parallel.schedule", p.schedule, SCHEDULE_CHOICES)
    if p.schedule in SPLIT_BACKWARD:
        resolve_schedule(p.schedule, p.vpp)  # its own chunk count
        if p.pp == 1:
            _fail("parallel.schedule", p.schedule, "fills a pipeline's idle slots, and parallel.pp=1 has none",
                  "use parallel.schedule=auto, or parallel.pp=2 or more")
    if p.vpp > 1 and p.pp == 1:
        _fail("parallel.vpp", p.vpp, "needs parallel.pp > 1 (virtual stages interleave across pipeline ranks)",
              "set parallel.pp=2 or more, or parallel.vpp=1")
    layers_per_stage(m.n_layers, p.pp, p.vpp, p.pp_layers)
    if p.pp == 1:
        return
    if z.stage == 3:
        _fail("zero.stage", 3, f"does not compose with parallel.pp={p.pp} (ZeRO-3 would re-gather every chunk's "
              "parameters for every micro-batch)", "use zero.stage=1 or 2 with a pipeline, or parallel.pp=1")
    micro = t.global_batch_size // (t.micro_batch_size * dp) if t.micro_batch_size * dp else 0
    if p.schedule != "gpipe" and 0 < micro < p.pp:
        _fail("train.global_batch_size", t.global_batch_size, f"gives {micro} micro-batches per pipeline "
              f"(micro_batch_size={t.micro_batch_size} x dp={dp}), fewer than parallel.pp={p.pp}, which 1F1B needs",
              f"use train.global_batch_size>={p.pp * t.micro_batch_size * dp} or parallel.schedule=gpipe")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
