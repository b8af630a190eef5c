"""One run's checkpoints, as the training loop sees them: the `Checkpointer` chooses what to resume and reads its
meta.json once, hands a weights-only checkpoint to the model build and loads a DeepSpeed one into the engine,
saves (in line, or staged and written in the background with checkpoint.async_save) with the time each save
held the loop, and turns a checkpoint.dir that filled up or went read-only into one line naming it and the
checkpoint still intact. The loop calls `save` and `after_step`, and knows nothing of the files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Callable

from megatron_lite.checkpoint import resume as checkpoint_resume
from megatron_lite.checkpoint import sharded, store
from megatron_lite.checkpoint import weights as checkpoint_weights
from megatron_lite.checkpoint.writer import AsyncWriter, checkpoint_group
from megatron_lite.engine.ds_checkpoint import with_vocab_rows
from megatron_lite.errors import RunError
from megatron_lite.layout import Layout
from megatron_lite.parallel.context import ParallelContext, set_collective_timeout

DISK_FULL_BYTES = 64 << 20  # below this much free space a failed checkpoint write is put down to a full disk


@contextlib.contextmanager
def said_if_unwritable(root: str, step: int):
    """A checkpoint write that fails on a full file system (PyTorch's zip writer says only "unexpected pos") or
    on one remounted read-only while the run lived ends the run with one line naming the directory, the cause and
    the checkpoint still intact, as a run that cannot go on (exit 3: a restart would fail the same way)."""
    try:
        yield
    except Exception as err:
        try:
            free = shutil.disk_usage(root).free
            read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
        except OSError:
            raise err from None
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err  # a background write's own error
        code = getattr(cause, "errno", None)
        if read_only or code == errno.EROFS:
            why, fix = "is read-only", "make it writable (or copy the checkpoints to a writable checkpoint.dir)"
        elif free < DISK_FULL_BYTES or code == errno.ENOSPC:
            why, fix = f"is full ({free >> 20} MiB free)", "free space (or lower checkpoint.keep)"
        else:
            raise
        latest = store.latest_checkpoint(root)
        raise RunError(
            f"checkpoint of step {step} could not be written: checkpoint.dir={root} {why} "
            f"({type(cause).__name__}: {' '.join(str(cause).split())[:120]}); "
            + (f"the last committed checkpoint, {latest}, is intact" if latest else "none was committed yet")
            + f": {fix} and resume"
        ) from err


class Checkpointer:
    """Resume choice, loads and saves of one run on one rank (every rank holds one; rank 0 commits)."""

    def __init__(self, cfg, ctx: ParallelContext, layout: Layout):
        self.cfg, self.ctx, self.layout = cfg, ctx, layout
        c = cfg.checkpoint
        self.dir, self.keep = c.dir, c.keep
        self.resume_path = checkpoint_resume.choose_resume(c.resume, c.dir, ctx)  # (every rank agrees)
        self.meta = store.read_meta(self.resume_path) if self.resume_path else None  # read once
        self.writer: AsyncWriter | None = None  # checkpoint.async_save's background writer, from `start`
        self.say: Callable[[str], None] = print

    @property
    def kind(self) -> str | None:
        """What the resumed checkpoint holds: "deepspeed" (the whole state), "weights" (an import), None (fresh)."""
        return self.meta["kind"] if self.meta is not None else None

    def imported_weights(self, vocab_rows: int) -> dict | None:
        """A weights-only checkpoint's full tensors for the model build, its vocabulary re-padded to this run's
        `vocab_rows` (it was written at tp 1); None unless resuming one."""
        if self.kind != "weights":
            return None
        _, tensors = checkpoint_weights.load_model_state(self.resume_path, verify=False)
        return {name: with_vocab_rows(name, tensor, vocab_rows) for name, tensor in tensors.items()}

    def load(self, engine) -> dict | None:
        """Load a DeepSpeed checkpoint into the engine; the meta of what this run continues (a weights-only
        checkpoint's was read into the model by the build; None for a fresh run)."""
        if self.kind == "deepspeed":
            sharded.load(engine, self.ctx, self.resume_path, self.meta, self.layout, scratch=self.dir)
        return self.meta

    def start(self, say: Callable[[str], None]) -> None:
        """From here saves say what they did through `say` (the run's logger); with checkpoint.async_save, the
        background writer starts."""
        self.say = say
        if self.cfg.checkpoint.async_save:
            timeout = self.cfg.dist.timeout_s
            self.writer = AsyncWriter(self.ctx.rank, self.ctx.world_size, timeout, say, checkpoint_group(timeout))

    def save(self, engine, step: int, meta: dict) -> dict:
        """A checkpoint of this step with `meta` in its meta.json (rank 0 commits it). Returns the time the loop
        was held (and the write time where it is known: in line, or the previous background save's)."""
        d = self.cfg.dist
        set_collective_timeout(d.timeout_s)  # ranks wait for the slowest writer in its barriers
        t0, out = time.perf_counter(), {}
        if self.writer is not None:  # the previous save may still be being written: wait (the wait counts as
            # held) and report it; a failure is its step's, not this one's
            with said_if_unwritable(self.dir, self.writer.step):
                out = self._written(self.writer.wait(reason=f"checkpoint of step {step}"))
        with said_if_unwritable(self.dir, step):
            if self.writer is None:
                path = sharded.save(engine, self.ctx, self.dir, step, meta, self.keep)
            else:
                path = sharded.save_async(engine, self.ctx, self.dir, step, meta, self.keep, self.writer)
        held = time.perf_counter() - t0
        set_collective_timeout(d.step_timeout_s)
        self.say(
            f"saved {path} (the loop waited {held:.2f} s)"
            if self.writer is None
            else f"saving {path} in the background (the loop waited {held:.2f} s for staging)"
        )
        return {"ckpt_block_s": held, **({"ckpt_write_s": held} if self.writer is None else out)}

    def after_step(self, record: dict, last: bool, reason: str) -> None:
        """Add a background save's write time to the step's record on the step it is known; on the `last` step
        wait for it (`reason` says why, in the wait's messages)."""
        if self.writer is None:
            return
        with said_if_unwritable(self.dir, self.writer.step):  # the save in flight's step
            written = self._written(self.writer.wait(reason=reason) if last else self.writer.finished())
        if written and "ckpt_write_s" in record:  # this step's save waited for the one before: both known
            record["ckpt_final_write_s"] = written["ckpt_write_s"]
        else:
            record.update(written)

    def _written(self, written: float | None) -> dict:
        """An asynchronous save's write time, said and logged on the step it is known (a later save's, when
        that one had to wait for it; on the last step, the last save's)."""
        if written is None:
            return {}
        self.say(
            f"checkpoint of step {self.writer.step} written"
            + (" and committed" if self.ctx.is_rank0 else "")
            + f" in {written:.2f} s in the background"
        )
        return {"ckpt_write_s": written}

    def close(self) -> None:
        """Stop the background writer (after a run that ended well; its saves are all written by then)."""
        if self.writer is not None:
            self.writer.close()
