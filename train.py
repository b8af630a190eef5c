"""Entry point: `python train.py [key=value ...]`, `torchrun --nproc-per-node N train.py ...`, or via slurm/.

Compose the config, validate it before any process group exists, then hand over to the training loop.
"""

from megatron_lite.faults import stop

stop.install()  # before the heavy imports below: a SIGUSR1/SIGTERM during start-up is caught too

from megatron_lite.cli import exit_process, main  # noqa: E402

if __name__ == "__main__":
    exit_process(main)  # megatron_lite/cli.py says why the process ends without the interpreter's teardown
