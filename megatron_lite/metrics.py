"""FLOPs model, MFU/HFU, and the per-step record to JSONL, console and wandb (global rank 0 only).

FLOPs convention (DESIGN §2; the README states it for users). Per token and layer, the forward pass
costs 2 x the multiply-adds of every matmul (h = d_model, a = n_heads, k = n_kv_heads, d_h = h / a,
f = ffn_hidden, s = seq_len, V = vocab):
    QKV projection      2 h (a + 2k) d_h
    attention scores    2 s h   x 1/2 (causal: only the lower triangle is needed)
    attention x values  2 s h   x 1/2
    output projection   2 h h
    MLP                 2 h f x (2 for GeLU, 3 for SwiGLU)
plus the LM head 2 h V once per token. Training = 3 x forward (forward, input grad, weight grad).
Embedding lookups, norms, softmax and element-wise ops are not counted. HFU adds the forward work that
activation recomputation repeats: all layers for `full`, the attention core for `selective`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch

from megatron_lite.config import ModelConfig

# Dense peak FLOP/s per device, from vendor datasheets (no sparsity).
PEAK_TABLE = {  # name fragment: {dtype: FLOP/s}
    "H200": {torch.bfloat16: 989e12, torch.float32: 494e12},   # fp32 via TF32 tensor cores
    "H100": {torch.bfloat16: 989e12, torch.float32: 494e12},   # SXM figures
    "A100": {torch.bfloat16: 312e12, torch.float32: 156e12},
}


def layer_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> tuple[float, float]:
    """Forward FLOPs per token of one layer: (dense matmuls, attention core)."""
    h, a, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.ffn
    d_h = cfg.head_dim
    qkv = 2 * h * (a + 2 * k) * d_h
    out = 2 * h * a * d_h
    mlp = 2 * h * f * (3 if cfg.activation == "swiglu" else 2)
    core = 2 * (2 * seq_len * a * d_h) * (0.5 if causal else 1.0)  # scores + values
    return qkv + out + mlp, core


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    dense, core = layer_flops_per_token(cfg, seq_len, causal)
    return cfg.n_layers * (dense + core) + 2 * cfg.d_model * cfg.vocab_size


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token: 3 x forward."""
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def step_flops(cfg: ModelConfig, tokens: int, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a training step over `tokens` tokens of length cfg.seq_len."""
    model = model_flops_per_token(cfg, cfg.seq_len) * tokens
    dense, core = layer_flops_per_token(cfg, cfg.seq_len)
    extra = {"none": 0.0, "selective": cfg.n_layers * core, "full": cfg.n_layers * (dense + core)}[recompute]
    return model, model + extra * tokens


@functools.lru_cache(maxsize=None)
def _probe_cpu_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in PEAK_TABLE.items():
            if fragment in name and dtype in peaks:
                return peaks[dtype], f"datasheet, {name}"
        return _probe_cuda_flops(dtype), f"measured matmul probe on {name} (not in the peak table)"
    return _probe_cpu_flops(dtype), f"measured {torch.get_num_threads()}-thread CPU matmul probe"


@functools.lru_cache(maxsize=None)
def _probe_cuda_flops(dtype: torch.dtype, n: int = 8192) -> float:
    a, b = torch.randn(n, n, dtype=dtype, device="cuda"), torch.randn(n, n, dtype=dtype, device="cuda")
    torch.mm(a, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - t0)


class MetricsLogger:
    """metrics.jsonl + wandb + a console progress line. Does nothing at all when enabled is False."""

    def __init__(self, run_dir: str, config_dict: dict, enabled: bool, wandb_mode: str = "auto",
                 wandb_project: str = "megatron_lite", wandb_entity: str | None = None,
                 run_name: str | None = None, wandb_id: str | None = None, total_steps: int = 0):
        self.enabled, self.total_steps = enabled, total_steps
        self._wandb, self._id = None, wandb_id
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self._progress = None
        if sys.stdout.isatty():  # a live bar on a terminal; plain lines in logs (Slurm, CI)
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(BarColumn(bar_width=24), TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
            self._task = self._progress.add_task("train", total=total_steps, status="starting")
            self._progress.start()
        if wandb_mode == "auto":
            wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if wandb_mode != "disabled":
            import wandb
            from wandb.sdk.lib.runid import generate_id

            self._id = wandb_id or generate_id()
            self._wandb = wandb.init(dir=run_dir, id=self._id, resume="allow", mode=wandb_mode,
                                     project=wandb_project, entity=wandb_entity, name=run_name,
                                     config=config_dict)

    @property
    def wandb_id(self) -> str | None:
        return self._id

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        line = (f"step {step:>6}/{self.total_steps}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                f"grad {metrics['grad_norm']:.3f}  {metrics['tokens_per_s']:,.0f} tok/s  "
                f"MFU {100 * metrics['mfu']:.2f}%")
        if "val_loss" in metrics:
            line += f"  val {metrics['val_loss']:.4f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=line)
        else:
            print(line, flush=True)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
