"""Building only this rank's share (model/build.py) on 2 gloo ranks, checked bitwise.

1. TP shards (tp=2, both model flavours, SP off and on, pp 1 and 2, vpp 1 and 2; the pipeline coordinate is
   set on the context, since building needs no pipeline group): the meta-built rank equals the old route
   (whole model, keep_chunks, parallelize) in names, values, TP marks, module types and buffers; and its shards,
   gathered over TP and reassembled here by hand, equal the tp=1 model with the same seed.
2. ZeRO-3 (dp=2): partitioning each parameter as it is built leaves every rank holding the same partition
   DeepSpeed makes from the whole built model in the engine.
Exits non-zero naming the first mismatch; rank 0 prints one line per passed group of cases.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from megatron_lite.config import Config, ModelConfig, ParallelConfig, ZeroConfig
from megatron_lite.engine import Engine
from megatron_lite.engine.ds_config import deepspeed_config
from megatron_lite.engine.zero_init import zero3_partitioner
from megatron_lite.layout import Layout
from megatron_lite.model.build import build_model
from megatron_lite.model.fused_rows import segments_of
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.parallel.context import ParallelContext, init_distributed
from megatron_lite.pipeline.partition import rank_chunks
from tests.distributed.rank_runner import leave_world
from tests.utils.models import LLAMA_STYLE

# vocab_multiple=48 pads the vocabulary to 1008 rows at tp=1 and to 1056 at tp=2, so the check against tp=1
# also covers padding that depends on tp.
FLAVOURS = {
    "gpt2": dict(n_layers=4, n_heads=4, d_model=64, vocab_size=1000, vocab_multiple=48, seq_len=16),
    "llama-gqa": dict(
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_model=64,
        ffn_hidden=96,
        vocab_size=1000,
        vocab_multiple=48,
        seq_len=16,
        **LLAMA_STYLE,
    ),
}


def fail(msg: str) -> None:
    sys.exit(f"rank {dist.get_rank()}: {msg}")


def gathered(shard: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return parts


def reassembled(name: str, p: torch.Tensor, cfg: ModelConfig, group) -> torch.Tensor:
    """The full tensor from every rank's shard, written out from the layouts in parallel/layers.py (not with
    the layers' own slicing code, which is what is under test)."""
    if not getattr(p, "tensor_model_parallel", False):
        return p
    parts = gathered(p, group)
    if p.partition_dim == 1:  # row-parallel: input columns
        return torch.cat(parts, dim=1)
    segments = segments_of(name, cfg)  # each rank holds [q_r | k_r | v_r], [gate_r | up_r] or [fc_r]
    if segments is None:  # vocabulary rows
        return torch.cat(parts, dim=0)
    tp = len(parts)
    pieces = [part.split([s // tp for s in segments]) for part in parts]
    return torch.cat([pieces[r][i] for i in range(len(segments)) for r in range(tp)])


def check_tp_shards(ctx: ParallelContext) -> None:
    for flavour, kw in FLAVOURS.items():
        for sp in (False, True):
            for pp, vpp in ((1, 1), (2, 1), (2, 2)):
                for pp_rank in range(pp):
                    check_tp_case(
                        ctx,
                        ModelConfig(**kw),
                        sp,
                        pp,
                        vpp,
                        pp_rank,
                        f"{flavour} tp=2 sp={sp} pp={pp} vpp={vpp} pp_rank={pp_rank}",
                    )
    if dist.get_rank() == 0:
        print("tp shards: meta build == whole model cut and sharded == tp=1 model, bitwise")


def check_tp_case(
    ctx: ParallelContext, model_cfg: ModelConfig, sp: bool, pp: int, vpp: int, pp_rank: int, tag: str
) -> None:
    cfg = Config(model=model_cfg, parallel=ParallelConfig(tp=2, pp=pp, vpp=vpp, sp=sp), seed=77)
    rank_ctx = dataclasses.replace(ctx, pp_rank=pp_rank, pp_size=pp)
    built = build_model(cfg, rank_ctx, Layout.of_run(cfg, 2 * pp))  # tp 2 x pp
    chunks = rank_chunks(pp_rank, pp, vpp, model_cfg.n_layers)
    old = parallelize(GPT(model_cfg, tp=2, seed=cfg.seed).keep_chunks(chunks), ctx.tp_group, sp)
    if [(n, type(m)) for n, m in built.named_modules()] != [(n, type(m)) for n, m in old.named_modules()]:
        fail(f"{tag}: modules differ from the old route")
    old_params = dict(old.named_parameters())
    if list(old_params) != [n for n, _ in built.named_parameters()]:
        fail(f"{tag}: parameter names differ from the old route")
    serial = dict(GPT(model_cfg, tp=1, seed=cfg.seed).named_parameters())
    for name, p in built.named_parameters():
        want = old_params[name]
        marks = [(getattr(t, "tensor_model_parallel", False), getattr(t, "partition_dim", None)) for t in (p, want)]
        if p.is_meta or not torch.equal(p, want) or marks[0] != marks[1]:
            fail(f"{tag}: {name} differs from the old route (TP marks {marks})")
        full, one = reassembled(name, p, model_cfg, ctx.tp_group), serial[name]
        rows = min(full.shape[0], one.shape[0])  # the padded vocabulary differs with tp; real rows must not
        if not torch.equal(full[:rows], one[:rows]) or full[rows:].abs().sum() != 0 or one[rows:].abs().sum() != 0:
            fail(f"{tag}: {name} gathered over TP is not the tp=1 model's")
    for (name, b), (_, want) in zip(built.named_buffers(), old.named_buffers()):
        if not torch.equal(b, want):
            fail(f"{tag}: buffer {name} differs")


def check_zero3_partitions() -> None:
    ctx = ParallelContext.build(tp=1, pp=1)  # dp = 2
    for flavour, kw in FLAVOURS.items():
        cfg = Config(model=ModelConfig(**kw), zero=ZeroConfig(stage=3), seed=78)
        # Built first, so that nothing (no engine) has set DeepSpeed up before it.
        layout = Layout.of_run(cfg, ctx.world_size)
        partition, dtype = zero3_partitioner(deepspeed_config(cfg, layout), ctx)
        built = build_model(cfg, ctx, layout, dtype=dtype, partition=partition)
        got = dict(built.named_parameters())
        # the route before: DeepSpeed splits the whole model
        engine = Engine(
            GPT(cfg.model, seed=cfg.seed),
            ctx,
            layout,
            deepspeed_config(cfg, layout),
            model_cfg=cfg.model,
            train=cfg.train,
        )
        want = dict(engine.model.named_parameters())
        if list(got) != list(want):
            fail(f"zero3 {flavour}: parameter names differ")
        for name, p in got.items():
            if p.numel() != 0 or tuple(p.ds_shape) != tuple(want[name].ds_shape):
                fail(f"zero3 {flavour}: {name} is not partitioned like the engine's ({tuple(p.shape)}, {p.ds_shape})")
            if not torch.equal(p.ds_tensor, want[name].ds_tensor):
                fail(f"zero3 {flavour}: rank {ctx.dp_rank}'s partition of {name} differs from the engine's")
        engine.close()
    if dist.get_rank() == 0:
        print("zero3: partitioned while built == partitioned by the engine, bitwise")


def main() -> None:
    init_distributed()
    check_tp_shards(ParallelContext.build(tp=2, pp=1))
    check_zero3_partitions()
    leave_world()  # tests/distributed/rank_runner.py says why


if __name__ == "__main__":
    main()
