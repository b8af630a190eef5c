"""train.py with a real fault injected: one rank SIGKILLs itself in the middle of writing a checkpoint.

Env: KILL_RANK (global rank to kill), KILL_TAG (e.g. step_0000004), SLOW_WRITE_S (optional: seconds the victim's
write takes before it dies). The victim writes a truncated file into the checkpoint directory first, so the
directory looks like a write that was cut off. With checkpoint.async_save the write, and so the kill, happens in
the background writer thread while the loop trains on.
"""

import os
import signal
import time

import torch

_real_save = torch.save


def _save_then_die(obj, f, *args, **kwargs):
    if os.environ["RANK"] == os.environ["KILL_RANK"] and isinstance(f, str) and os.environ["KILL_TAG"] in f:
        time.sleep(float(os.environ.get("SLOW_WRITE_S", "0")))  # a slow disk: the loop goes on meanwhile (async)
        with open(f, "wb") as out:
            out.write(b"truncated")
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_save(obj, f, *args, **kwargs)


torch.save = _save_then_die

from megatron_lite.cli import exit_process, main  # noqa: E402  (after the patch, so DeepSpeed sees it too)

if __name__ == "__main__":
    exit_process(main)
