"""train.py with a real NaN: the loss of micro-batch NAN_MICROBATCH (its index in the global batch; default
every one) is multiplied by NaN at the steps in NAN_STEPS (comma-separated), on the last pipeline stage. With
dp > 1 only the replica holding that micro-batch goes NaN, and the other replicas get it through the gradient
reduction, as a real overflow on one GPU would spread."""

import os

from megatron_lite.model.gpt import GPT

_forward = GPT.forward
STEPS = {int(s) for s in os.environ["NAN_STEPS"].split(",")}
MICROBATCH = os.environ.get("NAN_MICROBATCH")


def _forward_with_nan(self, inputs, labels=None, chunk=0, rng_key=None):
    out = _forward(self, inputs, labels, chunk=chunk, rng_key=rng_key)
    if labels is not None and rng_key is not None and rng_key[0] in STEPS and MICROBATCH in (None, str(rng_key[1])):
        out = out * float("nan")
    return out


GPT.forward = _forward_with_nan

from megatron_lite.cli import exit_process, main  # noqa: E402

if __name__ == "__main__":
    exit_process(main)
