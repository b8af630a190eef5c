"""Entry point: `python train.py [key=value ...]`, `torchrun --nproc-per-node N train.py ...`, or via slurm/.

Compose the config, validate it before any process group exists, then hand over to the training loop.
"""

import sys

from megatron_lite.cli import main

if __name__ == "__main__":
    sys.exit(main())
