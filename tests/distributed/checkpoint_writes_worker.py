"""worker.py's runs, recording which rank writes which checkpoint file.

torch.save is wrapped (DeepSpeed's checkpoint engine and ours write through it); after each run every rank's list of
the files it wrote under a `checkpoints` folder (paths relative to it) is gathered, and rank 0 adds them to the
run's summary as `checkpoint_writes`: one list per rank.
"""

import os
import sys

import torch
import torch.distributed as dist

from megatron_lite.cli import exit_process, resolved
from megatron_lite.training import run
from tests.distributed import worker

WRITES: list[str] = []


def install() -> None:
    save = torch.save

    def recorded(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and f"{os.sep}checkpoints{os.sep}" in str(f):
            WRITES.append(str(f).split(f"{os.sep}checkpoints{os.sep}", 1)[1])
        return save(obj, f, *args, **kwargs)

    torch.save = recorded


def recorded_run(overrides: list[str]) -> dict:
    WRITES.clear()
    summary = run(*resolved(overrides))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(WRITES))
    return {**summary, "checkpoint_writes": every}


def main(spec_path: str) -> int:
    install()
    return worker.main(spec_path, recorded_run)


if __name__ == "__main__":
    exit_process(lambda: main(sys.argv[1]))
