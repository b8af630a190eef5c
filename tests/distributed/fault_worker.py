"""train.py with a real fault injected: one rank SIGKILLs itself in the middle of writing a checkpoint.

Env: KILL_RANK (global rank to kill), KILL_TAG (e.g. step_0000004). The victim writes a truncated file
into the checkpoint directory first, so the directory looks like a write that was cut off.
"""

import os
import signal
import sys

import torch

_real_save = torch.save


def _save_then_die(obj, f, *args, **kwargs):
    if (os.environ["RANK"] == os.environ["KILL_RANK"] and isinstance(f, str)
            and os.environ["KILL_TAG"] in f):
        with open(f, "wb") as out:
            out.write(b"truncated")
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_save(obj, f, *args, **kwargs)


torch.save = _save_then_die

from megatron_lite.cli import main  # noqa: E402  (after the patch, so DeepSpeed sees it too)

if __name__ == "__main__":
    sys.exit(main())
