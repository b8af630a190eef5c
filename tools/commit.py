"""The commit a benchmark record names (every tools/bench_* and the tuners)."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The checkout's short commit; MEGATRON_LITE_COMMIT when set, since a tree copied to a GPU node may carry a
    stale .git or none."""
    if os.environ.get("MEGATRON_LITE_COMMIT"):
        return os.environ["MEGATRON_LITE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001 - outside a git checkout
        return "unknown"
