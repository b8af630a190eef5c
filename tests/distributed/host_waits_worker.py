"""worker.py's runs, counting where Engine.train_step makes the host wait for the device.

Counted inside train_step only, per run, each with the source line that made it:
- `device_syncs`: DeepSpeed's accelerator synchronize (torch.cuda.synchronize on a GPU: every stream drains);
- `host_reads`: a tensor's value read on the host (item, tolist, bool, float, int): on a GPU each one waits for the
  queue up to that tensor. On a CPU both are free, so only this count shows them;
- `cuda_syncs` (on CUDA only): what torch's sync debug mode flags, which also sees waits inside ops.
Rank 0 adds them to each run's summary as {kind: {site: count}}.
"""

import os
import sys
import traceback
import warnings
from collections import Counter

import torch

from megatron_lite.cli import exit_process, resolved
from megatron_lite.engine import Engine
from megatron_lite.training import run
from tests.distributed import worker
from tests.distributed.launcher import ROOT

COUNTS = {"device_syncs": Counter(), "host_reads": Counter(), "cuda_syncs": Counter()}
_inside = [False]  # whether a train_step is running


def _site() -> str:
    """The innermost frame outside this file and torch's own wrappers: who asked."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and f"{os.sep}torch{os.sep}" not in frame.filename:
            return (
                f"{os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename}"
                f":{frame.lineno}"
            )
    return "?"


def _counting(kind: str, method):
    def counted(*args, **kwargs):
        if _inside[0]:
            COUNTS[kind][_site()] += 1
        return method(*args, **kwargs)

    return counted


def install() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    accelerator.synchronize = _counting("device_syncs", accelerator.synchronize)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        setattr(torch.Tensor, name, _counting("host_reads", getattr(torch.Tensor, name)))
    train_step = Engine.train_step

    def counted_train_step(self, *args, **kwargs):
        _inside[0] = True
        try:
            if not torch.cuda.is_available():
                return train_step(self, *args, **kwargs)
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = train_step(self, *args, **kwargs)
            torch.cuda.set_sync_debug_mode("default")
            for w in caught:
                if "synchronizing" in str(w.message):
                    COUNTS["cuda_syncs"][f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1
            return out
        finally:
            _inside[0] = False

    Engine.train_step = counted_train_step


def counted_run(overrides: list[str]) -> dict:
    """worker.py's run, with this run's counts added to its summary."""
    for counter in COUNTS.values():
        counter.clear()
    return {**run(*resolved(overrides)), "host_waits": {k: dict(v) for k, v in COUNTS.items()}}


def main(spec_path: str) -> int:
    install()
    return worker.main(spec_path, counted_run)


if __name__ == "__main__":
    exit_process(lambda: main(sys.argv[1]))
