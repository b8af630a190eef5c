"""The configuration schema: Hydra structured configs, one dataclass per group.

YAML files under `configs/` hold presets only (model shapes); every key a user can override is a field
here, with its meaning in the docstring line beneath it. megatron_lite/validation/ checks a composed config.

Left out on purpose: expert parallelism (no config keys until it exists).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

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
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head attention)."""
    d_model: int = 128
    """Hidden size."""
    ffn_hidden: int | None = None
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
    pp_layers: list[int] | None = None
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
    """Directory used for nvme offload: each run swaps in a folder of its own under it, named after run.dir
    (<run.dir name>-<hash of its path>), removed when the run ends."""
    hpz: int = 1
    """ZeRO++ hpZ (DeepSpeed's zero_hpz_partition_size, stage 3): each rank also keeps a secondary shard of every
    parameter over groups of this many consecutive ZeRO ranks (within a node when it divides the GPUs per node
    over tp), so the backward's all-gathers stay inside a group; 1 = off. Must divide dp x cp."""
    shard_size: int | None = None
    """Hybrid sharding (HSDP): ZeRO partitions its states (stage 1: optimizer states; 2: and gradients; 3: and
    parameters) within groups of this many consecutive data-parallel ranks (with their cp ranks), and the groups
    hold replicas: each group's reduced gradients are averaged over the replicas before the step. A group sits in
    one node when shard_size x cp x tp divides the GPUs per node. null = one group of every dp rank. Must divide
    dp."""


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
    fp8: str = "none"
    """Float8 matmuls in the transformer blocks' projections through torchao (parallel/fp8.py): none, tensorwise
    (one scale per tensor), rowwise (one per row, more accurate) or rowwise_with_gw_hp (rowwise, the weight
    gradient in bf16: the most accurate); needs a GPU of compute capability 8.9+ (H100), and on a CPU runs
    torchao's emulation. The embedding and LM head stay high precision."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    eval_interval: int = 100
    """Validation loss every N steps on the held-out split (0 = never)."""
    eval_iters: int = 4
    """Global batches of held-out samples per validation pass (the same samples at every layout)."""
    eval_per_dataset: bool = False
    """With a blend (data.path a list): also each dataset's own validation loss, logged as val_loss/<path> (the
    entry as given, without a leading /), over eval_iters global batches of its held-out split; an evaluation
    then costs 1 + (number of datasets) passes."""
    log_interval: int = 1
    """Console progress-line update every N steps (metrics.jsonl always gets every step)."""
    profile_steps: list[int] | None = None
    """[first, last]: record torch.profiler over these steps (inclusive) and write a Chrome trace and an op table
    per profiled rank to ${run.dir}/profile/ (megatron_lite/metrics/profiling.py); null = never."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """The global ranks that profile train.profile_steps."""
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
    path: Any = "data/shakespeare-8k"
    """Directory written by tools/prepare_data.py (train.bin, val.bin, meta.json), relative to the repo; or a
    list of such directories (prepared with one tokenizer) to train on a blend of them."""
    weights: list[float] | None = None
    """With a list of paths: each one's share of the training (and validation) samples, normalized; null = in
    proportion to their training samples."""
    tokenizer: str | None = None
    """Local HF tokenizer directory data.path was prepared with; null = the one its meta.json records. When set,
    it must be that one (checked). An HF export copies it beside the weights."""
    document_mask: bool = False
    """Attention stays within each document of a training window and positions count from each document's start;
    a document's first token is not predicted from the one before, and the loss is the mean over the tokens
    predicted (docs/data.md)."""


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
    name: str | None = None
    """Run name for wandb; defaults to the last part of run.dir."""


@dataclass
class WandbConfig:
    mode: str = "auto"
    """auto (online with WANDB_API_KEY, else offline), offline, online or disabled."""
    project: str = "megatron_lite"
    """wandb project name."""
    entity: str | None = None
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
class FaultsConfig:
    straggler_ratio: float | None = 1.2
    """A rank whose busy time (its compute, not its waits in collectives) is this many times the median rank's
    is the slowest one named in metrics (slowest_rank, slowest_ratio, every train.log_interval steps); null
    measures nothing."""
    straggler_intervals: int = 5
    """Reports in a row the same rank must stay above straggler_ratio before it is warned of (or stopped for)."""
    straggler_action: str = "warn"
    """warn (a `warning:` line naming the rank and its host) or stop (checkpoint, then exit 5 with
    ${run.dir}/straggler.json naming the host, for a requeue that leaves it out)."""


@dataclass
class KernelsConfig:
    backend: str = "auto"
    """auto (Triton on CUDA for the ops measured faster there, kernels.TRITON_FASTER_ON_CUDA; torch elsewhere),
    triton (every op; TRITON_INTERPRET=1 on CPU) or torch."""


@dataclass
class ClusterConfig:
    """The machines a layout is planned for (`train.py --check` / `--plan`; megatron_lite/plan/hardware.py)."""

    gpu: str = "auto"
    """a100-40gb, a100-80gb, h100-sxm, h200, b200, or auto (this machine's GPU if the table knows it, else h100-sxm)."""
    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism stays within a node."""
    nodes: int | None = None
    """Nodes; None: as many as WORLD_SIZE needs for --check, 1 for --plan."""
    intra_node_GBps: float | None = None
    """Bus bandwidth between GPUs of a node, GB/s per direction; None: the GPU's NVLink."""
    inter_node_GBps: float | None = None
    """A node's network bandwidth, all NICs together, GB/s; None: one NIC per GPU, each as fast as one of the GPU's
    DGX/HGX node (8 NICs: 50 GB/s for H100), times gpus_per_node."""
    achievable: float | None = None
    """Fraction of the bf16 dense peak that GEMMs and attention sustain; null: the GPU class's measured rates
    (plan/hardware.py: on an H100, GEMMs 0.823 of peak plus 8 us a call, flash attention 0.285 plus 33 us; the
    A100s 0.65, fitted to Megatron-LM's runs). A number overrides them (docs/planner.md)."""
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
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 1234
    """Seed of weights, data order and dropout."""


def override_value(value) -> str:
    """A value as a Hydra override writes it (null, true/false), so that a suggested `key=value` can be pasted."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def data_paths(path) -> list[str]:
    """data.path as a list: one directory, or the directories of a blend."""
    return [path] if isinstance(path, str) else list(path)


def repo_path(path: str) -> str:
    """Resolve a data/tokenizer path: absolute as given, else relative to the repo root."""
    return path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)
