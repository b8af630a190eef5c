"""Measures each rank's memory for several layouts in one torchrun world, for the planner's validation.

argv[1]: a JSON file {"runs": [[override, ...], ...], "out": path}. For each run every rank builds its model and
engine as training.run does, with a LiveTensorBytes tracker (megatron_lite/memory.py) active from before the
model exists, and trains 3 steps. It records, for step 3 (steps 1 and 2 allocate what is created lazily):
  states     live bytes at the step boundary, split into the model's parameters (every storage a parameter or
             ZeRO-3 partition points into), the optimizer's (the master weights and states of the optimizer
             DeepSpeed wraps), and the rest (gradient buffers, buckets, scalars)
  saved_peak the most bytes autograd held for backward at once (a saved-tensor hook notes each saved
             storage, parameters excluded; weak references drop it when freed)
  peak       the tracker's peak live bytes in the step
Rank 0 writes every rank's records to `out`.
"""

import json
import sys
import weakref

import torch
import torch.distributed as dist

from megatron_lite.cli import load
from megatron_lite.config import repo_path
from megatron_lite.data.dataset import TokenData, WindowDataset
from megatron_lite.data.sampler import MicroBatches
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.engine import Engine
from megatron_lite.memory import LiveTensorBytes
from megatron_lite.model.build import build_model, zero3_partitioner
from megatron_lite.parallel.context import ParallelContext


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


class SavedBytes:
    """Live bytes of the storages autograd keeps for backward (parameters and buffers excluded), and their peak."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.live, self.peak, self._refs = model, 0, 0, {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs or isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        if storage.data_ptr() in {q.untyped_storage().data_ptr() for q in (*self.model.parameters(), *self.model.buffers())}:
            return t
        size = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.live += size
        self.peak = max(self.peak, self.live)
        return t

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)


def measure(overrides: list[str], ctx_cache: dict) -> dict:
    cfg = load(overrides)
    p = cfg.parallel
    key = (p.tp, p.pp, p.cp)
    if key not in ctx_cache:
        ctx_cache[key] = ParallelContext.build(p.tp, p.pp, p.cp)
    ctx = ctx_cache[key]
    tracker = LiveTensorBytes()
    with tracker:
        partition, dtype = None, torch.float32
        if cfg.zero.stage == 3:
            partition, dtype = zero3_partitioner(deepspeed_config(cfg, ctx.dp_size), ctx)
        model = build_model(cfg, ctx, dtype=dtype, partition=partition)
        model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
        engine = Engine(cfg, model, ctx)
        data = WindowDataset(TokenData(repo_path(cfg.data.path)).train, cfg.model.seq_len)
        batches = MicroBatches(data, cfg.seed, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                               ctx.dp_rank, ctx.dp_size)
        for step in (1, 2):
            engine.train_step(batches.next_step(), 1e-3, step)
        live = tracker.storages()
        params = _storages([*model.parameters(), *(getattr(q, "ds_tensor", None) for q in model.parameters())])
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        optimizer = _storages([*(q for g in inner.param_groups for q in g["params"]),
                               *(v for state in inner.state.values() for v in state.values()),
                               *getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])])  # ZeRO-3's master
        record = {"rank": dist.get_rank(), "pp_rank": ctx.pp_rank, "boundary": tracker.live,
                  "params": sum(n for ptr, n in live.items() if ptr in params),
                  "optimizer": sum(n for ptr, n in live.items() if ptr in optimizer and ptr not in params)}
        record["rest"] = record["boundary"] - record["params"] - record["optimizer"]
        saved = SavedBytes(model)
        tracker.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            engine.train_step(batches.next_step(), 1e-3, 3)
        record.update(peak=tracker.peak, saved_peak=saved.peak)
        engine.close()
    return record


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from megatron_lite.parallel.context import init_distributed

    init_distributed()
    contexts, results = {}, []
    for overrides in spec["runs"]:
        mine = measure(overrides, contexts)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append({"overrides": overrides, "ranks": every})
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
