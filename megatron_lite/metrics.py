"""FLOPs model, MFU/HFU, and the per-step record to JSONL, console and wandb (global rank 0 only).

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
the diagonal. Not counted: embedding lookups, norms, softmax, RoPE, biases and other element-wise work.
HFU adds the forward work that activation recomputation repeats in backward: each recomputed layer but
its last GEMM for `full`, the attention core for `selective` (recompute_flops_per_token says exactly what
torch reruns); the LM head is never recomputed.

Left out on purpose: MoE and multi-token-prediction terms (no such models here).
"""

from __future__ import annotations

import functools
import json
import netrc
import os
import secrets
import string
import subprocess
import sys
import time
from urllib.parse import urlparse

import torch

from megatron_lite.config import ModelConfig

RECOMPUTE_MODES = ("none", "selective", "full")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The checkout's short commit, which a run (wandb's run_facts) and every benchmark record name;
    MEGATRON_LITE_COMMIT when set, since a tree copied to a GPU node may carry a stale .git or none."""
    if os.environ.get("MEGATRON_LITE_COMMIT"):
        return os.environ["MEGATRON_LITE_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:  # noqa: BLE001 - outside a git checkout
        return "unknown"


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


def layer_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> tuple[int, int]:
    """Forward FLOPs per token of one transformer layer, split as (dense projections, attention core).

    dense = 2 h (a + 2k) d + 2 a d h + 2 h f m  (m = 2 for GeLU, 3 for SwiGLU);
    core = 2 * 2 s a d, halved when causal (scores QK^T and probabilities x V).
    """
    h, a, k, d, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
    qkv = 2 * h * (a + 2 * k) * d
    out = 2 * a * d * h
    mlp = 2 * h * f * (3 if cfg.activation == "swiglu" else 2)
    core = 2 * 2 * seq_len * a * d  # scores + values, the full s x s matrix
    return qkv + out + mlp, core // 2 if causal else core  # 4 s a d is even, so the half is exact


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
    cfg: ModelConfig, tokens: int, recompute: str = "none", recompute_every: int = 1, fused_core: bool = True
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a training step over `tokens` tokens of sequences cfg.seq_len long.

    hardware = model + what recomputation reruns (recompute_flops_per_token). MFU = model / (time x devices
    x peak); HFU likewise with hardware.
    """
    extra = recompute_flops_per_token(cfg, cfg.seq_len, recompute, recompute_every, fused_core)
    model = 3 * forward_flops_per_token(cfg, cfg.seq_len) * tokens
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


def _wandb_credentials() -> bool:
    """WANDB_API_KEY, or a netrc entry for the wandb host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
    try:
        return bool(os.path.isfile(path) and netrc.netrc(path).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """auto -> WANDB_MODE if it names offline/online/disabled, else online with credentials, else offline."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "")
    if env in ("offline", "online", "disabled"):
        return env
    return "online" if _wandb_credentials() else "offline"


def _plain(value):
    """A JSON-ready Python scalar from a float/int/tensor/numpy value (0-d tensors and numpy via .item())."""
    return value.item() if hasattr(value, "item") else value


def _status_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step:>{len(str(total))}}/{total}" if total else f"step {step}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "grad {:.3f}"),
        ("tokens_per_s", "{:,.0f} tok/s"),
    ):
        if isinstance(m.get(key), (int, float)):
            parts.append(fmt.format(m[key]))
    if isinstance(m.get("mfu"), (int, float)):
        parts.append(f"MFU {100 * m['mfu']:.2f}%")
    if isinstance(m.get("bubble"), (int, float)):
        parts.append(f"bubble {100 * m['bubble']:.1f}%")
    if isinstance(m.get("mem_peak_gib"), (int, float)):
        parts.append(f"mem {m['mem_peak_gib']:.2f} GiB")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    if m.get("restarts"):
        parts.append(f"restarts {m['restarts']}")
    return "  ".join(parts)


def _validation_line(step: int, m: dict) -> str:
    each = [f"{key.split('/', 1)[1]} {m[key]:.4f}" for key in m if key.startswith("val_loss/")]
    line = f"validation at step {step}: loss {m['val_loss']:.4f}, perplexity {m['val_ppl']:.2f}"
    return line + (f" ({', '.join(each)})" if each else "")


DROPPED = "metrics.dropped.jsonl"  # beside metrics.jsonl: records a restart or a new run set aside


def _drop_records_after(path: str, step: int) -> tuple[int, int]:
    """Rewrite the JSONL file at path without records of steps after `step` (and without a half-written last
    line), through a temporary file renamed over it, so a crash leaves the old file or the new one. The dropped
    records are appended to metrics.dropped.jsonl beside it first (a fresh run in a run.dir that held another
    run's history would otherwise erase it). Returns (records dropped, the last step among them)."""
    if not os.path.exists(path):
        return 0, 0
    with open(path) as f:
        lines = f.read().split("\n")
    kept, dropped, last = [], [], 0
    for line in lines[:-1]:  # the text after the last newline is a line some crash cut short
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped.append(line)
            last = max(last, record.get("step", 0))
    if len(kept) == len(lines) - 1 and lines[-1] == "":
        return 0, 0  # nothing to drop
    if dropped:
        with open(os.path.join(os.path.dirname(path), DROPPED), "a") as f:
            f.write("".join(line + "\n" for line in dropped))
            f.flush()
            os.fsync(f.fileno())
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(dropped), last


class MetricsLogger:
    """One record per optimizer step to ${run_dir}/metrics.jsonl (appended, flushed), wandb and the console.

    Only global rank 0 passes enabled=True; otherwise every method returns at once and nothing is created.
    wandb is imported only when the resolved mode is not `disabled` (the import costs ~1 s); its files go to
    ${run_dir}/wandb. Passing the wandb_id kept in a checkpoint continues the same wandb run (resume="allow").
    The console shows a rich progress bar on a terminal and a plain line per update otherwise (Slurm, CI),
    every `log_interval` steps and on the last step.
    """

    def __init__(
        self,
        run_dir: str,
        config_dict: dict,
        enabled: bool,
        wandb_mode: str = "auto",
        wandb_project: str = "megatron_lite",
        wandb_entity: str | None = None,
        run_name: str | None = None,
        wandb_id: str | None = None,
        total_steps: int = 0,
        log_interval: int = 1,
        start_step: int | None = None,
    ):
        """start_step: the step this run starts after (0 fresh, else the checkpoint's): metrics.jsonl's records
        of later steps, logged by a run that went on past its last checkpoint, are dropped, since they run again
        (None keeps every record)."""
        self.enabled, self.total_steps, self.log_interval = enabled, total_steps, max(1, log_interval)
        self._id, self._wandb, self._progress, self._jsonl = wandb_id, None, None, None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        dropped, last = _drop_records_after(path, start_step) if start_step is not None else (0, 0)
        self._jsonl = open(path, "a")
        if dropped:  # routine after a crash past the last checkpoint; worth a look when it is a whole other run
            self.print(
                f"metrics.jsonl: {dropped} record(s) of steps after {start_step} (up to {last}), which this run "
                f"starts before, moved to {DROPPED}"
            )
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            import wandb

            # wandb 0.31 has no public id generator (wandb.util.generate_id is gone); same format: 8 of [a-z0-9].
            self._id = wandb_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            # The run's .wandb file is written every second rather than wandb's 15 s: a crash loses what was not
            # written, and steps before the checkpoint a restart resumes are not logged again (see _fill_gap).
            self._wandb = wandb.init(
                dir=run_dir,
                id=self._id,
                resume="allow",
                mode=mode,
                project=wandb_project,
                entity=wandb_entity,
                name=run_name,
                config=config_dict,
                settings=wandb.Settings(x_transaction_log_flush_interval=1.0),
            )
            if start_step:
                self._fill_gap(path, start_step)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps or None, status="starting")
            self._progress.start()

    def _fill_gap(self, path: str, start_step: int) -> None:
        """A resumed wandb run that the server knows up to a step before `start_step` (a crash lost the steps
        after it that were not yet sent) gets those steps again from metrics.jsonl, which has every step up to
        the checkpoint. Offline, wandb does not know where its run ends (starting_step 0): nothing is re-logged."""
        first = getattr(self._wandb, "starting_step", 0) or 0
        if not 0 < first <= start_step:
            return
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if first <= record.get("step", 0) <= start_step:
                    self._wandb.log(record, step=record["step"])

    def describe(self, facts: dict) -> None:
        """What the config alone does not say (world and group sizes, accumulation, the precision and the peak
        FLOP/s behind MFU, the device, the commit) as the wandb config's `run_facts`."""
        if self._wandb is not None:
            self._wandb.config.update({"run_facts": facts}, allow_val_change=True)

    @property
    def wandb_id(self) -> str | None:
        """The wandb run id (store it in checkpoints to continue the same run); None without wandb."""
        return self._id

    def log(self, step: int, metrics: dict) -> None:
        """Append {"step": step, **metrics} to metrics.jsonl and wandb; refresh the console line."""
        if not self.enabled:
            return
        record = {"step": step, **{key: _plain(value) for key, value in metrics.items() if key != "step"}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if any(key.startswith("val_loss") for key in record):  # every evaluation, whatever the log_interval
            self.print(_validation_line(step, record))
        if step % self.log_interval and step != self.total_steps:
            return
        line = _status_line(step, self.total_steps, record)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=line.split("  ", 1)[-1])
        else:
            print(line, flush=True)

    def print(self, message: str) -> None:
        """A rank-0 message printed above the progress bar (or as a plain line)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def close(self, failed: bool = False) -> None:
        """Stop the progress bar, close metrics.jsonl and finish the wandb run (marked failed, exit code 1, when
        the run ended by an error); safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None
