"""The per-step record to metrics.jsonl, the console and wandb (global rank 0 only), and the commit a run names.
MFU and HFU come from metrics/flops.py."""

from __future__ import annotations

import json
import netrc
import os
import secrets
import string
import subprocess
import sys
from urllib.parse import urlparse

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    if isinstance(m.get("slowest_ratio"), (int, float)):
        parts.append(f"slowest rank {m['slowest_rank']} {m['slowest_ratio']:.2f}x")
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

    def histogram(self, key: str, values: list[float], step: int) -> None:
        """wandb only: a histogram of one value per rank (metrics.jsonl keeps the summary, not world-size lists)."""
        if self.enabled and self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Histogram(values)}, step=step)

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
