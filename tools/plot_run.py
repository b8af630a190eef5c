"""Plot a run's metrics: `python tools/plot_run.py ${run.dir}` writes ${run.dir}/metrics.png.

Four panels from metrics.jsonl: training (and validation) loss, tokens/s, MFU (and HFU), learning rate.
"""

from __future__ import annotations

import json
import os
import sys


def plot(run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"plot_run: {path} does not exist; give a run.dir that a train.py run has logged to")
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:  # only the last line may be cut off (a run still writing it)
                raise SystemExit(f"plot_run: {path} line {i + 1} is not JSON; was the file edited?") from None
    if not rows:
        raise SystemExit(f"plot_run: {run_dir}/metrics.jsonl has no rows yet")
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(steps, [r["loss"] for r in rows], label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    for key in sorted({k for r in rows for k in r if k.startswith("val_loss/")}):  # train.eval_per_dataset
        each = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*each), ".--", label=f"validation: {key.split('/', 1)[1]}")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    axes[0, 1].plot(steps, [r["tokens_per_s"] for r in rows])
    axes[0, 1].set(title="tokens / s", xlabel="step")
    axes[1, 0].plot(steps, [100 * r["mfu"] for r in rows], label="MFU")
    axes[1, 0].plot(steps, [100 * r["hfu"] for r in rows], "--", label="HFU")
    axes[1, 0].set(title="utilisation (%)", xlabel="step")
    axes[1, 0].legend()
    axes[1, 1].plot(steps, [r["lr"] for r in rows])
    axes[1, 1].set(title="learning rate", xlabel="step")
    fig.suptitle(os.path.abspath(run_dir))
    out = os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/plot_run.py RUN_DIR")
    print(plot(sys.argv[1]))
