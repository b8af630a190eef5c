"""The commit a benchmark record names (every tools/bench_* and the tuners): megatron_lite.metrics.logger.git_commit,
which a training run's wandb run_facts name too."""

from megatron_lite.metrics.logger import git_commit

__all__ = ["git_commit"]
