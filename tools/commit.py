"""What a benchmark record names: the commit (every tools/bench_* and the tuners: megatron_lite.metrics.logger.git_commit,
which a training run's wandb run_facts name too), and the common fields of a CPU benchmark's record."""

import datetime

from megatron_lite.metrics.logger import git_commit

__all__ = ["cpu_record", "git_commit"]


def cpu_record(bench: str, **fields) -> dict:
    """A CPU (gloo) benchmark's JSON record: its name, its own fields, today's date and this commit."""
    return {
        "bench": bench,
        **fields,
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": "CPU (gloo)",
    }
