"""Start N gloo ranks with torchrun on this machine and collect what rank 0 reports."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

from megatron_lite.parallel.context import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "distributed", "worker.py")


def clean_shared_memory() -> None:
    """DeepSpeed's CPU comm buffers and torchrun's scratch dirs must not pile up between tests."""
    for path in glob.glob("/dev/shm/deepspeed_*") + glob.glob("/tmp/torchelastic_*"):
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def torchrun_cmd(nproc: int, script: str, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", f"--max-restarts={max_restarts}", script, *args]


def rank_env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    env.update(extra)
    return env


def run_configs(nproc: int, runs: list[list[str]], tmp_path, timeout: int = 900) -> list[dict]:
    """Train each override list in one `nproc`-rank torchrun world; return rank 0's summaries."""
    spec = os.path.join(tmp_path, f"spec_{nproc}_{len(os.listdir(tmp_path))}.json")
    out = spec.replace(".json", ".out.json")
    with open(spec, "w") as f:
        json.dump({"runs": runs, "out": out}, f)
    try:
        proc = subprocess.run(torchrun_cmd(nproc, WORKER, spec), env=rank_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        clean_shared_memory()
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)
