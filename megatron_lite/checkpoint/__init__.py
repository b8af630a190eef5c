"""Checkpoints, one module per idea (what DeepSpeed writes and reads is engine/'s: the Engine's save and loads,
engine/ds_checkpoint.py, and our loaders in engine/repairs/):

- manager: the Checkpointer, all the training loop sees (resume choice, loads, saves, a full or read-only dir)
- sharded: DeepSpeed's sharded save and load, the RNG streams
- universal: the layout-free form a change of layout, ZeRO stage or precision converts to
- store: the files (step directories, the manifest, the commit with fsync, candidates, pruning)
- resume: which checkpoint a run resumes (auto's fallback) and whether it can (layout, data-stream comparisons)
- weights: weights-only checkpoints and full merged weights (HF import/export)
- writer: checkpoint.async_save (host copies, background writer, rank 0's commit)
"""

from megatron_lite.checkpoint.sharded import load, save, save_async

__all__ = ["load", "save", "save_async"]
