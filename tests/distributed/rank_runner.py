"""torchrun's entry for tests/distributed/ranks.on_ranks: on this rank, start gloo, import the function the spec
names, call it with the spec's args and write its return value as JSON to <out>.<rank>.json."""

import importlib
import json
import sys

import torch.distributed as dist


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    module, name = spec["function"].split(":")
    function = getattr(importlib.import_module(module), name)
    dist.init_process_group("gloo")
    value = function(*spec["args"])
    with open(f"{spec['out']}.{dist.get_rank()}.json", "w") as f:
        json.dump(value, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
