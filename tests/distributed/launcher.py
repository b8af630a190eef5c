"""Start N gloo ranks with torchrun on this machine and collect what rank 0 reports."""

from __future__ import annotations

import getpass
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

from megatron_lite.parallel.context import free_port, torchrun_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "distributed", "worker.py")
# The TMPDIR of every process this test session starts (torchrun's torchelastic_* dirs land here), so the
# cleanup below never touches another run's; removed at the end of the session (tests/conftest.py).
SCRATCH = os.path.join(tempfile.gettempdir(), f"megatron_lite_tests_{os.getpid()}")


def _mapped_shared_memory() -> set[str]:
    """/dev/shm files some live process has mapped: DeepSpeed buffers of a run still going (this one's or not)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[5] for line in f if "/dev/shm/deepspeed_" in line)
        except OSError:  # the process ended meanwhile
            continue
    return mapped


def clean_shared_memory() -> None:
    """DeepSpeed's CPU comm buffers left by ended runs and this session's torchrun dirs must not pile up."""
    in_use = _mapped_shared_memory()
    for path in glob.glob("/dev/shm/deepspeed_*"):
        if path not in in_use:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue
    for path in glob.glob(os.path.join(SCRATCH, "torchelastic_*")):
        shutil.rmtree(path, ignore_errors=True)


def torchrun_cmd(nproc: int, script: str, *args: str, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        f"--max-restarts={max_restarts}",
        script,
        *args,
    ]


def rank_env(**extra: str) -> dict:
    os.makedirs(SCRATCH, mode=0o755, exist_ok=True)
    env = torchrun_env(ROOT, WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false", TMPDIR=SCRATCH)
    # compiled kernels are cached where they would be without the TMPDIR above, for the next session
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    env.update(extra)
    return env


def override_value(run: list[str], key: str, default: str | None = None) -> str | None:
    """The value an override list gives `key` (the last one wins, as in Hydra), or `default`."""
    values = [o.split("=", 1)[1] for o in run if o.startswith(f"{key}=")]
    return values[-1] if values else default


def resumes(run: list[str]) -> bool:
    """Whether a run may load a checkpoint (checkpoint.resume other than never: the default is auto). Such a run
    starts in a world of its own: a resume is tested in processes that hold nothing of the run it continues."""
    return override_value(run, "checkpoint.resume", "auto") != "never"


def compiles(run: list[str]) -> bool:
    """Whether a run compiles its blocks (train.compile=true). Such a run starts in a world of its own: dynamo's
    caches live as long as the process (its recompile limit would count other tests' graphs), and the compiled
    graphs it installs in the model's module keep the process groups they captured (worker.check_nothing_left)."""
    return override_value(run, "train.compile", "false").lower() == "true"


def _spec(path: str, runs: list[list[str]]) -> str:
    """Write worker.py's spec file (the runs, and where rank 0 puts their summaries); return its path."""
    with open(path, "w") as f:
        json.dump({"runs": runs, "out": path.replace(".json", ".out.json")}, f)
    return path


def _summaries(spec: str) -> list[dict]:
    with open(spec.replace(".json", ".out.json")) as f:
        return json.load(f)


def run_configs(nproc: int, runs: list[list[str]], tmp_path, timeout: int = 900, worker: str = WORKER) -> list[dict]:
    """Train each override list in one `nproc`-rank torchrun world; return rank 0's summaries (`worker`: a script
    that takes worker.py's spec file). worker.py's own specs go to the session's pool worlds of that size, unless a
    run resumes or compiles; one-rank runs use one of the two cores, so two pool worlds train the two halves of
    the list at once."""
    from tests.distributed import pool

    name = os.path.join(tmp_path, f"spec_{nproc}_{len(os.listdir(tmp_path))}")
    if worker == WORKER and pool.enabled() and not any(resumes(r) or compiles(r) for r in runs):  # pool.py
        cut = (len(runs) + 1) // 2 if nproc == 1 else len(runs)
        specs = [_spec(f"{name}.{i}.json", part) for i, part in enumerate((runs[:cut], runs[cut:])) if part]
        try:
            pool.run(nproc, specs, timeout)
        finally:
            clean_shared_memory()
        return [summary for spec in specs for summary in _summaries(spec)]
    spec = _spec(f"{name}.json", runs)
    try:
        proc = subprocess.run(
            torchrun_cmd(nproc, worker, spec), env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    finally:
        clean_shared_memory()
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return _summaries(spec)
