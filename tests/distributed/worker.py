"""Runs several training configs in one torchrun world (process groups are reused between them).

argv[1]: a JSON file holding {"runs": [[override, ...], ...], "out": path}. Rank 0 writes, per run, the
per-step losses and the final summary to `out` as JSON.
"""

import json
import sys

import torch.distributed as dist

from megatron_lite.cli import exit_process, load
from megatron_lite.training import run


def main(spec_path: str, train=lambda overrides: run(load(overrides))) -> int:
    """train(overrides) -> a run's summary (host_waits_worker.py passes one that also counts)."""
    with open(spec_path) as f:
        spec = json.load(f)
    results = [{"overrides": overrides, **train(overrides)} for overrides in spec["runs"]]
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(lambda: main(sys.argv[1]))
