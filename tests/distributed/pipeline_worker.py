"""The pipeline (partition + schedule + executor + tied-embedding sync) against the serial model: loss and
every gradient, for pp x vpp x schedule x flavour, with no DeepSpeed in the way.

Run on 4 gloo ranks by tests/distributed/test_pipeline.py (ranks.on_ranks); each case builds its own
ParallelContext (pp=4, or pp=2 with two replicas that run the same micro-batches). Every rank builds the serial
model with the seed, keeps only its chunks, runs one step's schedule over m micro-batches and the tied sync, and
compares each parameter it holds with the serial model's gradient of the same global name: relative error
||pipe - serial|| / ||serial||.

Why TOL = 1e-6: the serial reference also backpropagates micro-batch by micro-batch (loss_i / m), so a block's
gradient sums the same terms in the same order (measured exactly 0). The exception is the tied embedding:
the serial model adds head and lookup gradients per micro-batch, the pipeline adds each stage's total once,
which reorders fp32 additions (a few ulps, measured <= 1.1e-7). A lost micro-batch is O(1/m), a missing
embedding-group sum O(1), a 1/m applied twice O(1).
zb_h1 (B and W split, parallel/weight_grad.py) and zbv (two chunks in a V; the tied embedding and head both on
rank 0, so no sync) run for m in {pp, 2pp, 3pp+1}. zb_h1 is also compared with 1F1B, which holds the same
layers on each rank: its deferred weight gradients use the formulas of autograd's own linear and embedding
backwards, accumulated in 1F1B's order, so they must be bitwise equal (measured 0).
Each case also checks that sent activations gave up their storage (executor.py): chunk outputs held at once
stay below two activations' bytes (one full output waits for its send at a time; keeping them would hold one
per micro-batch in flight, >= 2 on the first rank of every schedule here).
`results()` returns, per case, the largest errors over all ranks, the largest difference from 1F1B (zb_h1) and
the peak of kept chunk outputs in activations; the test holds them to their bounds.
"""

from functools import reduce

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.model.tied import tie_across_stages
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.pipeline.executor import PipelineExecutor
from megatron_lite.pipeline.partition import rank_chunks
from megatron_lite.pipeline.schedules import resolve_schedule
from tests.distributed.tp_worker import worse, worst_over_ranks
from tests.utils.models import LLAMA_STYLE

FLAVOURS = {
    "gpt2-tied": dict(n_heads=4, d_model=32, vocab_size=300, seq_len=16),
    "llama-untied": dict(
        n_heads=4,
        n_kv_heads=2,
        d_model=32,
        ffn_hidden=48,
        vocab_size=300,
        seq_len=16,
        **LLAMA_STYLE,
    ),
}
TOL = 1e-6
MICRO_BATCH = 2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def serial_step(cfg: ModelConfig, batches: list[torch.Tensor]) -> tuple[float, dict]:
    torch.manual_seed(7)
    model = GPT(cfg)
    total = 0.0
    for batch in batches:
        loss = model(batch[:, :-1], batch[:, 1:])
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {name: p.grad for name, p in model.named_parameters()}


def pipeline_step(cfg: ModelConfig, ctx: ParallelContext, vpp: int, schedule: str, batches):
    torch.manual_seed(7)
    model = GPT(cfg).keep_chunks(rank_chunks(ctx.pp_rank, ctx.pp_size, vpp, cfg.n_layers, v_shape=schedule == "zbv"))
    tie_across_stages(model, ctx.embed_group, ctx.pp_rank, ctx.pp_size)
    executor = PipelineExecutor(
        model.chunks,
        resolve_schedule(schedule, vpp),
        ctx.pp_size,
        ctx.pp_rank,
        (MICRO_BATCH, cfg.seq_len, cfg.d_model),
        torch.float32,
        ctx.device,
        ctx.pp_global_rank,
        ctx.pp_group,
    )
    stats = executor.run(model, batches)
    if model.tied is not None:
        model.tied.sync(model)
    return stats, dict(model.named_parameters())


def results() -> list[dict]:
    """One record per case, the same on every rank: {case, gradients, loss (largest relative errors), vs_1f1b
    (zb_h1: largest absolute gradient difference from 1F1B, else None), kept (peak chunk-output bytes held at
    once, in activations), held (parameters held over the pipeline), serial (parameters of the serial model)}."""
    world = dist.get_world_size()
    cases = [
        (flavour, pp, vpp, schedule, m)
        for flavour in FLAVOURS
        for pp in (2, 4)
        for vpp in (1, 2)
        for schedule in ("gpipe", "1f1b", "interleaved")
        if not (schedule == "interleaved" and vpp == 1)
        for m in ((pp, 2 * pp + 1) if schedule == "interleaved" else (pp,))
    ]
    cases += [
        (flavour, pp, vpp, schedule, m)
        for flavour in FLAVOURS
        for pp in (2, 4)
        for schedule, vpp in (("zb_h1", 1), ("zbv", 2))
        for m in (pp, 2 * pp, 3 * pp + 1)
    ]
    out = []
    for flavour, pp, vpp, schedule, m in cases:
        cfg = ModelConfig(name=flavour, n_layers=2 * pp * vpp, **FLAVOURS[flavour])
        ctx = ParallelContext.build(tp=1, pp=pp) if world % pp == 0 else None
        gen = torch.Generator().manual_seed(m)
        batches = [torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen) for _ in range(m)]
        want_loss, want_grads = serial_step(cfg, batches)
        stats, params = pipeline_step(cfg, ctx, vpp, schedule, batches)
        worst = {
            "gradients": reduce(worse, (relative_error(p.grad, want_grads[name]) for name, p in params.items()), 0.0),
            "loss": 0.0 if stats.loss is None else abs(stats.loss.item() - want_loss) / want_loss,
            "vs_1f1b": 0.0,
            "kept": stats.peak_kept_bytes / (MICRO_BATCH * cfg.seq_len * cfg.d_model * 4),
        }
        if schedule == "zb_h1":  # the same layers on each rank as 1F1B
            _, params_1f1b = pipeline_step(cfg, ctx, vpp, "1f1b", batches)
            worst["vs_1f1b"] = reduce(
                worse, ((p.grad - params_1f1b[name].grad).abs().max().item() for name, p in params.items()), 0.0
            )
        worst = worst_over_ranks(worst)
        held = torch.tensor([float(len(params))])
        dist.all_reduce(held)
        out.append(
            {
                "case": f"{flavour} pp={pp} vpp={vpp} {schedule} m={m}",
                **worst,
                "vs_1f1b": worst["vs_1f1b"] if schedule == "zb_h1" else None,
                "held": int(held.item()) // (world // pp),
                "serial": len(want_grads),
            }
        )
    return out
