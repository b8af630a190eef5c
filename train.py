"""Entry point: `python train.py [key=value ...]`, `torchrun --nproc-per-node N train.py ...`, or via slurm/.

Compose the config, validate it before any process group exists, then hand over to the training loop.
"""

import sys

from megatron_lite.faults import stop

stop.install()  # before the heavy imports below: a SIGUSR1/SIGTERM during start-up is caught too

from megatron_lite.cli import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    stop.ignore()  # the run is over; a stop signal during the interpreter's shutdown must not turn 0 into 143
    sys.exit(code)
