"""torchrun's entry for tests/distributed/ranks.on_ranks: on this rank, start gloo, import the function the spec
names, call it with the spec's args and write its return value as JSON to <out>.<rank>.json."""

import importlib
import json
import sys

import torch.distributed as dist

from megatron_lite.cli import exit_process


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    module, name = spec["function"].split(":")
    function = getattr(importlib.import_module(module), name)
    dist.init_process_group("gloo")
    value = function(*spec["args"])
    with open(f"{spec['out']}.{dist.get_rank()}.json", "w") as f:
        json.dump(value, f)
    leave_world()


def leave_world() -> None:
    """End a test worker's gloo world: a barrier (every rank is done), then exit 0 through cli.exit_process,
    without the interpreter's teardown, in which gloo's worker threads can abort a finished rank (seen here once
    in a tp=4 world after its value was written)."""
    dist.barrier()
    exit_process(lambda: 0)


if __name__ == "__main__":
    main(sys.argv[1])
