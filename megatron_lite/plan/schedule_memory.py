"""Which activations a pipeline rank holds at once, from the order its schedule runs (pipeline/schedules.py).

Walking a rank's computations in order gives, at every moment, how many micro-batches each of its chunks holds
activations for, whether a backward is running (and of which chunk: its transient comes on top), and which
chunks have finished a backward before (their gradients exist from then on, for ZeRO-0/1). The peak for given
per-chunk sizes is the largest weighted sum over those moments. The moments depend only on (schedule, pp, vpp,
m, rank), so they are computed once and reduced to the ones that can be a maximum for any sizes (no other
moment holds at least as much of everything); pricing a layout then takes a few multiplications.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_lite.pipeline.schedules import SPLIT_BACKWARD, iterations


@dataclass(frozen=True)
class Moment:
    held: tuple[int, ...]  # micro-batches whose activations each chunk holds
    backward: int | None  # the chunk whose backward is running (its transient applies), or None
    grads: tuple[bool, ...]  # chunks that have run a backward before this moment


def _dominated(a: Moment, b: Moment) -> bool:
    """b holds at least as much as a in every respect (so a never sets the peak alone)."""
    return (
        a != b
        and all(x <= y for x, y in zip(a.held, b.held))
        and all(x <= y for x, y in zip(a.grads, b.grads))
        and (a.backward is None or a.backward == b.backward)
    )


@functools.lru_cache(maxsize=8192)
def moments(schedule: str, pp: int, vpp: int, m: int, pp_rank: int) -> tuple[Moment, ...]:
    """The moments of rank `pp_rank` that can hold its peak: after each forward, and during each backward (its
    chunk's activations for that micro-batch still held). Zero-bubble schedules are priced as if a micro-batch
    held all its activations until its W (what W needs, its linears' inputs and output gradients, is most of
    them), so their weight gradients exist from the first W on: an upper bound."""
    held, grads, seen = [0] * vpp, [False] * vpp, set()
    release = "W" if schedule in SPLIT_BACKWARD else "B"
    for it in iterations(schedule, pp, vpp, m, pp_rank):
        for step in it:
            c = step.chunk
            if step.kind == "F":
                held[c] += 1
                seen.add(Moment(tuple(held), None, tuple(grads)))
                continue
            if step.kind == "B":
                seen.add(Moment(tuple(held), c, tuple(grads)))
            if step.kind == release:
                held[c] -= 1
                grads[c] = True
    return tuple(x for x in seen if not any(_dominated(x, y) for y in seen))


def peak_activations(
    schedule: str,
    pp: int,
    vpp: int,
    m: int,
    pp_rank: int,
    per_micro: list[int],
    loss_transient: list[int],
    grad_transient: list[int],
    grad_bytes: list[int],
    held_once: int = 0,
) -> tuple[int, Moment]:
    """(the most bytes held at once in the step's forwards and backwards, the moment it happens).

    per_micro[c]: bytes chunk c keeps per micro-batch in flight; grad_bytes[c]: gradient buffers that exist once
    chunk c has finished a backward; held_once: allocated at the step's first parameter gradient and held to the
    optimizer step (ZeRO-1's reduce bucket). A backward of chunk c has two candidate peaks: the loss's backward
    (loss_transient[c], before any parameter gradient of this backward, so held_once only from an earlier one)
    and the parameter gradients' (grad_transient[c], with held_once).
    """
    best, where = -1, None
    for x in moments(schedule, pp, vpp, m, pp_rank):
        total = sum(n * a for n, a in zip(x.held, per_micro))
        total += sum(g for done, g in zip(x.grads, grad_bytes) if done)
        started = any(x.grads)
        if x.backward is not None:
            c = x.backward
            total += max(loss_transient[c] + (held_once if started else 0), grad_transient[c] + held_once)
        elif started:
            total += held_once
        if total > best:
            best, where = total, x
    return best, where


def most_held(schedule: str, pp: int, vpp: int, m: int, pp_rank: int, per_micro: list[int]) -> int:
    """The most activation bytes the rank's chunks keep for backward at once (no transients)."""
    return max(sum(n * a for n, a in zip(x.held, per_micro)) for x in moments(schedule, pp, vpp, m, pp_rank))
