"""Every check of a composed configuration, before any process group starts: `check(cfg, world_size)` runs them
in order and raises `ConfigError` with one line that names the key as typed, the value, why it is wrong and a fix.

  validate(cfg, world_size)    the config alone: shapes, layout, ZeRO, batch, optimizer, data, logging
  check_offload_support(cfg)   this machine: NVMe offload needs DeepSpeed's async-io op
  check_resume(cfg)            the checkpoint a resume would load (checkpoint/resume.py, which knows the files)

`notes(cfg)` lists settings that are valid but do nothing or less than they seem to; the run prints them as
warnings (so does --check).

Deeper layers keep their invariants as asserts; where a rule belongs to a module's own arithmetic (a pipeline's
layers per stage, a schedule's chunk count) that module raises the ConfigError and validate calls it.
"""

from __future__ import annotations

import json
import math
import os

from megatron_lite.checkpoint.store import meta_problem
from megatron_lite.config import ClusterConfig, Config, data_paths, repo_path
from megatron_lite.data.sampler import BLEND_BLOCK
from megatron_lite.errors import ConfigError
from megatron_lite.pipeline.partition import layers_per_stage
from megatron_lite.pipeline.schedules import SCHEDULE_CHOICES, SPLIT_BACKWARD, resolve_schedule
from megatron_lite.plan.hardware import gpu_named


def check(cfg: Config, world_size: int) -> None:
    """Everything that can be checked before a process group or a model exists (raises ConfigError)."""
    from megatron_lite.checkpoint.resume import check_resume

    validate(cfg, world_size)
    check_offload_support(cfg)
    check_resume(cfg)


def notes(cfg: Config) -> list[str]:
    """Valid settings that do nothing or less than they seem to, one line each (key, value, what happens)."""
    t, o, out = cfg.train, cfg.optim, []
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        out.append("parallel.sp=true does nothing at parallel.tp=1 (it splits the sequence over the TP ranks)")
    if cfg.parallel.pp == 1 and cfg.parallel.schedule != "auto":  # (zb_h1 and zbv at pp=1 are refused)
        out.append(
            f"parallel.schedule={cfg.parallel.schedule} does nothing at parallel.pp=1 (it orders a pipeline's "
            "micro-batches)"
        )
    if o.warmup_steps > t.steps:
        out.append(
            f"optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the run ends in its warmup, at a "
            f"learning rate of {o.lr * t.steps / o.warmup_steps:.3g} (optim.lr={o.lr})"
        )
    if t.eval_per_dataset and len(data_paths(cfg.data.path)) == 1:
        out.append("train.eval_per_dataset=true does nothing with one data.path (val_loss is that dataset's)")
    if t.profile_steps is not None and t.profile_steps[1] > t.steps:
        out.append(
            f"train.profile_steps={list(t.profile_steps)} ends after train.steps={t.steps}: the profile "
            "stops at the last step"
        )
    if t.recompute_every != 1 and t.recompute != "full":
        out.append(
            f"train.recompute_every={t.recompute_every} does nothing without train.recompute=full (it is {t.recompute})"
        )
    if t.eval_interval > t.steps:
        out.append(f"train.eval_interval={t.eval_interval} > train.steps={t.steps}: this run never evaluates")
    return out


def _tokenizer_of(meta: dict) -> tuple:
    """What a prepared dataset was tokenized with: the tokenizer's directory however its path was written, its
    size and end-of-document id."""
    path = meta.get("tokenizer")
    return path and os.path.realpath(repo_path(path)), meta.get("vocab_size"), meta.get("eos_id")


def _itemsize(meta: dict) -> int:
    import numpy as np

    return np.dtype(meta.get("dtype", "uint16")).itemsize


def _fail(key: str, value, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value} {why}; {fix}")


def _check_data(cfg: Config) -> None:
    """data.path (one prepared directory or a blend of several) and data.weights, from each one's meta.json."""
    d, m = cfg.data, cfg.model
    if not isinstance(d.path, str) and not (
        isinstance(d.path, (list, tuple)) and d.path and all(isinstance(p, str) for p in d.path)
    ):
        _fail(
            "data.path",
            d.path,
            "must be a prepared data directory or a non-empty list of them",
            "use data.path=data/mine or data.path=[data/a,data/b]",
        )
    paths = data_paths(d.path)
    key = (lambda k: "data.path") if isinstance(d.path, str) else (lambda k: f"data.path[{k}]")
    metas = []
    for k, path in enumerate(paths):
        if not os.path.exists(os.path.join(repo_path(path), "meta.json")):
            _fail(
                key(k),
                path,
                "has no prepared data (meta.json missing)",
                f"run `make data` or `python tools/prepare_data.py --tokenizer {d.tokenizer or '<tokenizer dir>'} "
                f"--out {path}`",
            )
        with open(os.path.join(repo_path(path), "meta.json")) as f:
            metas.append(json.load(f))
    for k, meta in enumerate(metas[1:], 1):
        if _tokenizer_of(meta) != _tokenizer_of(metas[0]):
            _fail(
                key(k),
                paths[k],
                f"was prepared with tokenizer {meta.get('tokenizer')} ({meta.get('vocab_size')} "
                f"tokens), {key(0)}={paths[0]} with {metas[0].get('tokenizer')} ({metas[0].get('vocab_size')})",
                "prepare every dataset of a blend with the same tokenizer (tools/prepare_data.py --tokenizer)",
            )
    recorded = metas[0].get("tokenizer")
    if d.tokenizer is not None:
        if not os.path.isdir(repo_path(d.tokenizer)):
            _fail(
                "data.tokenizer",
                d.tokenizer,
                "is not a directory",
                "give the local HF tokenizer directory the data "
                "was prepared with, or data.tokenizer=null to take the one its meta.json records",
            )
        if (
            recorded is not None
            and os.path.isdir(repo_path(recorded))
            and os.path.realpath(repo_path(recorded)) != os.path.realpath(repo_path(d.tokenizer))
        ):
            _fail(
                "data.tokenizer",
                d.tokenizer,
                f"is not the tokenizer {key(0)}={paths[0]} was prepared with ({recorded})",
                f"use data.tokenizer={recorded}, or data.tokenizer=null to take the data's",
            )
    if len(set(map(os.path.realpath, map(repo_path, paths)))) < len(paths):
        _fail(
            "data.path",
            list(paths),
            "names a directory twice",
            "list each once and give it a larger data.weights entry",
        )
    for k, meta in enumerate(metas):
        for split in ("train", "val"):  # both are mapped at start-up (an empty split is one element long)
            file = os.path.join(repo_path(paths[k]), f"{split}.bin")
            tokens = meta.get(f"{split}_tokens", 0)
            held = os.path.getsize(file) // _itemsize(meta) if os.path.isfile(file) else None
            if held is None or held < max(tokens, 1):
                _fail(
                    key(k),
                    paths[k],
                    f"has {'no ' + split + '.bin' if held is None else f'{held} tokens in {split}.bin'}"
                    f" where its meta.json records {tokens}",
                    "prepare it again with tools/prepare_data.py",
                )
        for split, needed, fix in (
            ("train", True, "use more data"),
            (
                "val",
                cfg.train.eval_interval > 0,
                "prepare it with a larger --val-fraction of tools/prepare_data.py, or set train.eval_interval=0",
            ),
        ):
            tokens = meta.get(f"{split}_tokens", 0)
            if needed and (tokens - 1) // m.seq_len < 1:
                _fail(
                    key(k),
                    paths[k],
                    f"has {tokens} {split} tokens, too few for one sample of model.seq_len + 1 = {m.seq_len + 1}",
                    f"{fix}, or a smaller model.seq_len",
                )
    data_vocab = metas[0].get("vocab_size", 0)
    if data_vocab > m.vocab_size:
        _fail(
            "model.vocab_size",
            m.vocab_size,
            f"is smaller than {key(0)}={paths[0]}'s tokenizer ({data_vocab} tokens)",
            f"use model.vocab_size>={data_vocab} or data prepared with a smaller tokenizer",
        )
    if d.weights is None:
        return
    weights = list(d.weights)
    if len(weights) != len(paths):
        _fail(
            "data.weights",
            weights,
            f"has {len(weights)} entries for {len(paths)} data.path directories",
            "give one weight per directory of data.path (a list), or data.weights=null",
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        _fail(
            "data.weights",
            weights,
            "must all be positive numbers",
            "drop a dataset from data.path instead of giving it weight 0",
        )
    smallest = min(weights) / sum(weights)
    if smallest < 1 / BLEND_BLOCK:
        _fail(
            "data.weights",
            weights,
            f"gives a dataset {smallest:.2g} of the blend, under the 1/{BLEND_BLOCK} a blending block can hold",
            f"raise its weight to at least {sum(weights) / BLEND_BLOCK:.3g} or drop it",
        )


def _positive(key: str, value: float, example: str) -> None:
    if not (math.isfinite(value) and value > 0):
        _fail(key, value, "must be a positive number", f"use e.g. {example}")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        _fail(key, value, "is not a valid choice", f"use one of {', '.join(map(str, allowed))}")


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def validate(cfg: Config, world_size: int) -> None:
    """Check cfg for this world size; raise ConfigError with a one-line explanation on the first problem."""
    m, p, z, t, o = cfg.model, cfg.parallel, cfg.zero, cfg.train, cfg.optim

    # --- model shape ---
    for key in ("n_layers", "n_heads", "d_model", "vocab_size", "vocab_multiple", "seq_len"):
        if getattr(m, key) <= 0:
            _fail(f"model.{key}", getattr(m, key), "must be positive", "pick a positive integer")
    if m.d_model % m.n_heads:
        _fail("model.n_heads", m.n_heads, f"must divide model.d_model={m.d_model}", f"try {_divisors(m.d_model)}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        _fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}", f"try {_divisors(m.n_heads)}")
    if m.ffn_hidden is not None and m.ffn_hidden <= 0:
        _fail("model.ffn_hidden", m.ffn_hidden, "must be positive", "pick a positive integer or null for 4*d_model")
    _choice("model.norm", m.norm, ("layernorm", "rmsnorm"))
    _choice("model.activation", m.activation, ("gelu", "swiglu"))
    _choice("model.position", m.position, ("learned", "rope"))
    if m.position == "rope" and m.head_dim % 2:
        _fail(
            "model.position",
            m.position,
            f"needs an even head dim, got {m.head_dim}",
            "change model.d_model or model.n_heads",
        )
    if not 0.0 <= m.dropout < 1.0:
        _fail("model.dropout", m.dropout, "must be in [0, 1)", "use e.g. 0.0 or 0.1")
    for key, example in (("norm_eps", "1e-5"), ("init_std", "0.02"), ("rope_theta", "10000.0")):
        _positive(f"model.{key}", getattr(m, key), example)  # a negative norm_eps trains on NaN from step 1

    # --- parallel layout ---
    for key in ("tp", "pp", "vpp", "cp"):
        if getattr(p, key) < 1:
            _fail(f"parallel.{key}", getattr(p, key), "must be >= 1", "use 1 to disable")
    if world_size % (p.tp * p.cp * p.pp):
        key, val = next(((f"parallel.{k}", v) for k, v in (("pp", p.pp), ("cp", p.cp)) if v > 1), ("parallel.tp", p.tp))
        _fail(
            key,
            val,
            f"makes tp*cp*pp={p.tp * p.cp * p.pp} (tp={p.tp}, cp={p.cp}, pp={p.pp}), which must divide the "
            f"world size {world_size}",
            f"pick tp*cp*pp among {_divisors(world_size)}",
        )
    for key, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads), ("model.ffn_hidden", m.ffn)):
        if val % p.tp:
            # KV heads are split, never replicated, so tp must divide them too (see model/parallelize.py).
            _fail("parallel.tp", p.tp, f"must divide {key}={val}", f"try {_divisors(val)}")
    if p.sp and m.seq_len % p.tp:
        _fail(
            "parallel.sp",
            p.sp,
            f"needs parallel.tp={p.tp} to divide model.seq_len={m.seq_len}",
            "change model.seq_len or parallel.tp",
        )
    _validate_context_parallel(cfg, world_size)
    _validate_cluster(cfg.cluster)
    dp = world_size // (p.tp * p.cp * p.pp)
    _validate_pipeline(cfg, dp)

    # --- ZeRO ---
    _choice("zero.stage", z.stage, (0, 1, 2, 3))
    _choice("zero.offload_optimizer", z.offload_optimizer, ("none", "cpu", "nvme"))
    _choice("zero.offload_param", z.offload_param, ("none", "cpu", "nvme"))
    if z.offload_optimizer != "none" and z.stage == 0:
        _fail("zero.offload_optimizer", z.offload_optimizer, "needs zero.stage >= 1", "set zero.stage=1, 2 or 3")
    if z.offload_param != "none" and z.stage != 3:
        _fail(
            "zero.offload_param",
            z.offload_param,
            f"needs zero.stage=3 (got {z.stage})",
            "set zero.stage=3 or zero.offload_param=none",
        )
    if z.offload_optimizer == "nvme" and z.stage != 3:  # DeepSpeed's ZeRO-1/2 take any device as CPU, silently
        _fail(
            "zero.offload_optimizer",
            "nvme",
            f"needs zero.stage=3 (got {z.stage}: DeepSpeed's ZeRO-1 and -2 offload the optimizer to CPU memory only)",
            "set zero.stage=3, or zero.offload_optimizer=cpu",
        )
    if "nvme" in (z.offload_optimizer, z.offload_param):
        if not z.nvme_path:
            _fail(
                "zero.nvme_path",
                repr(z.nvme_path),
                "is empty (the swap files would go to the working directory)",
                "give the NVMe directory, e.g. zero.nvme_path=/local_nvme/swap",
            )
        _check_writable("zero.nvme_path", z.nvme_path)

    # --- batch and steps ---
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, key) <= 0:
            _fail(f"train.{key}", getattr(t, key), "must be positive", "pick a positive integer")
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"must be a multiple of train.micro_batch_size={t.micro_batch_size} x dp={dp}",
            f"use {t.micro_batch_size * dp * max(1, t.global_batch_size // (t.micro_batch_size * dp))}"
            " or change train.micro_batch_size",
        )
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
        _fail(
            "train.compile",
            True,
            "does not work with zero.stage=3 (ZeRO-3 gathers and frees parameters in "
            "module hooks that a compiled block would trace through)",
            "use zero.stage=1 or 2, or train.compile=false",
        )
    if not (math.isfinite(t.grad_clip) and t.grad_clip >= 0):  # nan compared false: clipping silently off
        _fail("train.grad_clip", t.grad_clip, "must be a finite number >= 0", "use 1.0, or 0 to disable clipping")
    if t.eval_interval < 0 or t.eval_iters <= 0:
        key, val = (
            ("train.eval_interval", t.eval_interval) if t.eval_interval < 0 else ("train.eval_iters", t.eval_iters)
        )
        _fail(key, val, "is out of range", "eval_interval >= 0 (0 = never), eval_iters >= 1")
    if t.log_interval <= 0:
        _fail("train.log_interval", t.log_interval, "must be positive", "use 1")
    if t.profile_steps is not None:
        steps = list(t.profile_steps)
        if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1]:
            _fail(
                "train.profile_steps",
                steps,
                "must be [first, last] steps with 1 <= first <= last",
                "use e.g. [5,7] (after the first step's warm-up), or null",
            )
    bad_ranks = [r for r in t.profile_ranks if not (isinstance(r, int) and 0 <= r < world_size)]
    if bad_ranks or not t.profile_ranks:
        _fail(
            "train.profile_ranks",
            list(t.profile_ranks),
            f"must name ranks of the {world_size} in this run",
            "use e.g. [0]" + (f" or [0,{world_size - 1}]" if world_size > 1 else ""),
        )

    # --- optimizer ---
    if not (o.lr > 0 and math.isfinite(o.lr)):
        _fail("optim.lr", o.lr, "must be a positive number", "use e.g. 3e-4")
    if not 0 <= o.min_lr <= o.lr:  # nan too (an lr of nan after warmup)
        _fail("optim.min_lr", o.min_lr, f"must be in [0, optim.lr={o.lr}]", "use e.g. optim.lr / 10")
    if o.warmup_steps < 0:
        _fail("optim.warmup_steps", o.warmup_steps, "must be >= 0", "use e.g. 1% of train.steps")
    _choice("optim.decay", o.decay, ("cosine", "linear", "constant"))
    if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0):
        _fail("optim.weight_decay", o.weight_decay, "must be a finite number >= 0", "use e.g. 0.1, or 0 for none")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        _fail("optim.betas", list(o.betas), "must be two numbers in [0, 1)", "use [0.9,0.95]")
    _positive("optim.eps", o.eps, "1e-8")

    if not 0 <= cfg.seed < 2**63:  # numpy's generators refuse a negative seed, torch's one past 64 bits
        _fail("seed", cfg.seed, "must be in [0, 2**63)", "use e.g. seed=1234")

    # --- data, checkpoints, logging ---
    _check_data(cfg)
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.keep < 0:
        key = "checkpoint.interval" if cfg.checkpoint.interval < 0 else "checkpoint.keep"
        _fail(key, getattr(cfg.checkpoint, key.split(".")[1]), "must be >= 0", "use 0 to disable")
    r = cfg.checkpoint.resume
    if r not in ("auto", "never") and not os.path.isfile(os.path.join(r, "meta.json")):
        _fail(
            "checkpoint.resume",
            r,
            "is not a complete checkpoint directory (no meta.json)",
            "use auto, never, or a path to a step_<N> directory",
        )
    problem = meta_problem(r) if r not in ("auto", "never") else None
    if problem is not None:
        _fail(
            "checkpoint.resume",
            r,
            f"cannot be loaded: {problem}",
            "resume another checkpoint, or checkpoint.resume=auto",
        )
    for key, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):  # (the second in the first)
        _check_writable(key, path)
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, ("auto", "offline", "online", "disabled"))
    _choice("kernels.backend", cfg.kernels.backend, ("auto", "triton", "torch"))
    if cfg.kernels.backend == "triton" and not _has_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
        _fail(
            "kernels.backend",
            "triton",
            "needs a GPU, or Triton's CPU interpreter (slow; for tests)",
            "use kernels.backend=auto, or export TRITON_INTERPRET=1 before starting",
        )


def _check_writable(key: str, path: str) -> None:
    """A directory the run will write (it may not exist yet): not a file, and its nearest existing ancestor
    writable, so that a read-only mount is said now, not at the first save after hours of training."""
    if not path:  # os.makedirs("") fails: at start-up for run.dir, at the first save for checkpoint.dir
        _fail(
            key,
            "''",
            "is empty",
            f"give a directory, e.g. {key}=runs/mine" + ("/checkpoints" if key == "checkpoint.dir" else ""),
        )
    if os.path.exists(path) and not os.path.isdir(path):
        _fail(key, path, "is a file, not a directory", f"use another {key}")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        _fail(
            key,
            path,
            f"cannot be written ({existing} is {'read-only' if os.path.isdir(existing) else 'a file'})",
            f"use a writable {key}",
        )


def _validate_context_parallel(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel

    def fits_world(c: int) -> bool:  # a suggested cp must also leave tp*cp*pp dividing the world size
        return world_size % (p.tp * c * p.pp) == 0

    _choice("parallel.cp_mode", p.cp_mode, ("ring", "ulysses"))
    if p.cp == 1:
        return
    # The load-balanced causal split cuts the sequence into 2*cp equal chunks; SP then splits a rank's share over tp.
    chunks = 2 * p.cp * (p.tp if p.sp else 1)
    if m.seq_len % chunks:
        what = f"2*cp*tp={chunks} (with parallel.sp)" if p.sp and p.tp > 1 else f"2*cp={chunks}"
        fit = [c for c in range(1, m.seq_len + 1) if m.seq_len % (2 * c * (p.tp if p.sp else 1)) == 0 and fits_world(c)]
        _fail(
            "parallel.cp",
            p.cp,
            f"needs {what} to divide model.seq_len={m.seq_len} (each rank holds two of 2*cp equal chunks)",
            f"use parallel.cp in {fit or [1]} or change model.seq_len",
        )
    if p.cp_mode == "ulysses":
        for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads)):
            local = heads // p.tp
            if local % p.cp:
                fit = [
                    c
                    for c in range(1, local + 1)
                    if (m.n_heads // p.tp) % c == 0 and (m.kv_heads // p.tp) % c == 0 and fits_world(c)
                ]
                _fail(
                    "parallel.cp",
                    p.cp,
                    f"with parallel.cp_mode=ulysses must divide the {key.split('.')[1]} per "
                    f"TP rank ({key}={heads} / parallel.tp={p.tp} = {local})",
                    f"use parallel.cp in {fit}, or parallel.cp_mode=ring (any head count)",
                )
    if cfg.train.compile:
        _fail(
            "train.compile",
            True,
            f"does not work with parallel.cp={p.cp} (the attention's ring or all-to-all "
            "would break every compiled block's graph)",
            "use train.compile=false or parallel.cp=1",
        )


GPU_CHOICES = ("auto", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200")  # plan/hardware.py's table


def _validate_cluster(c: ClusterConfig) -> None:
    _choice("cluster.gpu", c.gpu, GPU_CHOICES)
    for key in ("gpus_per_node", "nodes"):
        value = getattr(c, key)
        if value is not None and value < 1:
            _fail(f"cluster.{key}", value, "must be >= 1", "e.g. cluster.gpus_per_node=8 cluster.nodes=4")
    for key in ("intra_node_GBps", "inter_node_GBps"):
        value = getattr(c, key)
        if value is not None and not 0 < value < math.inf:
            _fail(
                f"cluster.{key}",
                value,
                "must be a positive bandwidth in GB/s",
                "e.g. 450, or null for the GPU's default",
            )
    if not 0 < c.achievable <= 1:
        _fail("cluster.achievable", c.achievable, "must be a fraction in (0, 1]", "e.g. 0.65")
    gpu_gib = gpu_named(c.gpu).memory_bytes / 2**30
    if not 0 <= c.reserve_gib < gpu_gib:  # NaN too
        _fail(
            "cluster.reserve_gib",
            c.reserve_gib,
            f"must be in [0, {gpu_gib:.1f}) GiB, the memory of one {gpu_named(c.gpu).name}",
            "e.g. 2",
        )


def _validate_pipeline(cfg: Config, dp: int) -> None:
    m, p, z, t = cfg.model, cfg.parallel, cfg.zero, cfg.train
    _choice("parallel.schedule", p.schedule, SCHEDULE_CHOICES)
    if p.schedule in SPLIT_BACKWARD:
        resolve_schedule(p.schedule, p.vpp)  # its own chunk count
        if p.pp == 1:
            _fail(
                "parallel.schedule",
                p.schedule,
                "fills a pipeline's idle slots, and parallel.pp=1 has none",
                "use parallel.schedule=auto, or parallel.pp=2 or more",
            )
    if p.vpp > 1 and p.pp == 1:
        _fail(
            "parallel.vpp",
            p.vpp,
            "needs parallel.pp > 1 (virtual stages interleave across pipeline ranks)",
            "set parallel.pp=2 or more, or parallel.vpp=1",
        )
    layers_per_stage(m.n_layers, p.pp, p.vpp, p.pp_layers)
    if p.pp == 1:
        return
    if z.stage == 3:
        _fail(
            "zero.stage",
            3,
            f"does not compose with parallel.pp={p.pp} (ZeRO-3 would re-gather every chunk's "
            "parameters for every micro-batch)",
            "use zero.stage=1 or 2 with a pipeline, or parallel.pp=1",
        )
    micro = t.global_batch_size // (t.micro_batch_size * dp) if t.micro_batch_size * dp else 0
    if p.schedule != "gpipe" and 0 < micro < p.pp:
        _fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"gives {micro} micro-batches per pipeline "
            f"(micro_batch_size={t.micro_batch_size} x dp={dp}), fewer than parallel.pp={p.pp}, which the "
            f"{resolve_schedule(p.schedule, p.vpp)} schedule needs (every one but gpipe)",
            f"use train.global_batch_size>={p.pp * t.micro_batch_size * dp} or parallel.schedule=gpipe",
        )


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def check_offload_support(cfg: Config) -> None:
    """NVMe offload needs DeepSpeed's async-io op; say so before any process group starts."""
    z = cfg.zero
    if "nvme" in (z.offload_optimizer, z.offload_param):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            key = "zero.offload_optimizer" if z.offload_optimizer == "nvme" else "zero.offload_param"
            raise ConfigError(
                f"{key}=nvme needs DeepSpeed's async_io op, which cannot build here (libaio missing); "
                "install libaio-dev (apt) or use cpu offload"
            )
