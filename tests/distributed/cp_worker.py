"""Context parallelism (alone, and with TP + SP) vs the serial model with the same weights: loss, logits and
every gradient, for both modes and both model flavours; then dropout under cp: recomputation and a rerun
reproduce the forward's masks bit for bit.

Run on 4 gloo ranks by tests/distributed/test_context_parallel.py (ranks.on_ranks), one process group for every
case: the grid is rebuilt per layout (cp=4; cp=2 with two data-parallel replicas that must agree with the serial
model independently; tp=2 x cp=2 with sequence parallelism). `errors(backend)`: backend is the parallel model's
kernels (torch, or triton in Triton's interpreter); the serial model always runs the torch references.

Each rank holds a shard of the sequence, so its gradients are partial sums: they are summed over the cp group
(what DeepSpeed's reduction over dp x cp does, parallel/context.py) and then compared with the same TP shard of
the serial model's gradients, as a relative error ||got - want|| / ||want|| (see TOL). The loss of a cp rank is
its share of the sequence mean, so the loss summed over cp must equal the serial loss; each rank's logits must
equal its shard of the serial logits. Every rank returns the largest error of each case over all ranks (a
bitwise case: the largest absolute difference), and the test holds them to TOL (bitwise ones to 0).
"""

import copy
from functools import reduce

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.model.parallelize import parallelize
from megatron_lite.model.parallelize_cp import cp_parallelize
from megatron_lite.parallel import context_parallel
from megatron_lite.parallel.context import ParallelContext
from megatron_lite.parallel.context_parallel import ring_attention, shard_sequence
from megatron_lite.parallel.layers import shard_segments
from megatron_lite.parallel.random import keep_mask
from tests.distributed.tp_worker import FLAVOURS, relative_error, segments_of, worse, worst_over_ranks

# In fp32 the cp model only reorders additions: attention over key blocks merged by log-sum-exp (ring) or
# reordered sequences (Ulysses), gradients summed over cp ranks, plus TP's sharded matmuls and sums where tp > 1.
# That moves a few ulps of each norm (eps 1.2e-7); a wrong causal rule, a lost block, a missing or doubled cp
# sum are O(1) (a doubled loss share: 1.0), a 1.01 scale 1e-2.
TOL = 2e-5

# Sequence lengths (tokens per sample): 16 gives chunks of 2 tokens at cp=4 (so the causal diagonal falls inside
# every chunk pair on the diagonal), 8 gives one-token chunks at cp=4.
SEQ_LENS = (16, 8)


def check(tag: str, error: float, worst: dict) -> None:
    """The case's largest error so far on this rank."""
    worst[tag] = worse(worst.get(tag, 0.0), error)


def compare(ctx: ParallelContext, flavour: str, mode: str, backend: str, worst: dict) -> None:
    cp, tp, sp = ctx.cp_size, ctx.tp_size, ctx.tp_size > 1
    cfg = ModelConfig(**FLAVOURS[flavour])
    serial = GPT(cfg, tp=tp, seed=3)
    model = cp_parallelize(parallelize(copy.deepcopy(serial), ctx.tp_group, sp), ctx.cp_group, mode)
    model.set_kernels(backend)
    tag = f"{flavour} cp={cp} ({mode}) tp={tp} sp={sp} kernels={backend}"
    for s in SEQ_LENS:
        if s % (2 * cp * tp):
            continue
        serial.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, s + 1), generator=torch.Generator().manual_seed(s))
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss_s = serial(x, y)
        loss_s.backward()
        share = model(x, y)
        share.backward()
        loss = share.detach().clone()
        dist.all_reduce(loss, group=ctx.cp_group)
        check(tag, relative_error(loss, loss_s.detach()), worst)
        with torch.no_grad():
            check(tag, relative_error(model(x), shard_sequence(serial(x), 1, cp, ctx.cp_rank)), worst)
        serial_params = dict(serial.named_parameters())
        for name, p in model.named_parameters():
            want = serial_params[name].grad
            if getattr(p, "tensor_model_parallel", False):
                want = shard_segments(
                    want, segments_of(name, cfg, want, p.partition_dim), p.partition_dim, ctx.tp_group
                )
            if p.grad is None or p.grad.shape != want.shape:
                raise AssertionError(f"{tag}: {name} has no gradient or the wrong shape")
            got = p.grad.clone()
            dist.all_reduce(got, group=ctx.cp_group)  # the cp ranks' partial gradients
            check(tag, relative_error(got, want), worst)


def dropout_reproduces(ctx: ParallelContext, mode: str, worst: dict) -> None:
    """With dropout 0.1 at cp=2: full and selective recomputation, and a second run, give the no-recompute
    run's loss and gradients exactly (every mask is keyed, never drawn in turn)."""
    cfg = ModelConfig(**{**FLAVOURS["llama-gqa"], "dropout": 0.1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    runs = {}
    for recompute in ("none", "full", "selective", "none again"):
        model = cp_parallelize(GPT(cfg, seed=3), ctx.cp_group, mode).train()
        model.set_recompute(recompute.split()[0])
        loss = model(tokens[:, :-1], tokens[:, 1:], rng_key=(7, 1))
        loss.backward()
        runs[recompute] = [loss.detach()] + [p.grad for p in model.parameters()]
    undropped = cp_parallelize(GPT(cfg, seed=3), ctx.cp_group, mode).eval()(tokens[:, :-1], tokens[:, 1:])
    if torch.equal(undropped, runs["none"][0]):
        raise AssertionError(f"dropout cp=2 ({mode}): dropout changed nothing")
    worst[f"dropout cp=2 ({mode}) recompute full/selective and rerun: bitwise"] = reduce(
        worse,
        (
            (got - want).abs().max().item()
            for recompute in ("full", "selective", "none again")
            for got, want in zip(runs[recompute], runs["none"])
        ),
        0.0,
    )


def ring_matches_masked_attention(ctx: ParallelContext, worst: dict, p: float, fused: bool) -> None:
    """Ring attention against plain causal attention, by autograd, with the same dropout masks (one per
    pair of global chunks and tile, parallel/context_parallel.py): output and the gradients of q, k and v
    (GQA). Without dropout both block kernels (fused: torch's CPU flash kernel; explicit) are checked; with
    dropout the explicit one runs whatever blocks= asks for (auto)."""
    cp, r = ctx.cp_size, ctx.cp_rank
    b, heads, kv_heads, s, hd = 2, 4, 2, 8 * cp, 8
    g = torch.Generator().manual_seed(11)
    q, k, v, grad = (torch.randn(b, h, s, hd, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    c, key, tile = s // (2 * cp), (7, 1, 0, 2, "attn_probs"), context_parallel.ROW_TILE
    keep = torch.cat(
        [
            torch.cat(
                [keep_mask((*key, i, j, t), None, (b, heads, min(tile, c - t), c), p, q.device) for j in range(2 * cp)],
                dim=-1,
            )
            for i in range(2 * cp)
            for t in range(0, c, tile)
        ],
        dim=-2,
    )  # one mask per (query chunk, key chunk, tile of query rows)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    fq, fk, fv = full[0], *(x.repeat_interleave(heads // kv_heads, dim=1) for x in full[1:])
    scores = (fq @ fk.transpose(-1, -2) / hd**0.5).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -torch.inf)
    want = (scores.softmax(-1) * keep / (1 - p)) @ fv
    want.backward(grad)
    local = [shard_sequence(x, 2, cp, r).requires_grad_() for x in (q, k, v)]
    calls, fused_forward = [], context_parallel._fused_forward
    context_parallel._fused_forward = lambda *args: calls.append(1) or fused_forward(*args)
    got = ring_attention(*local, ctx.cp_group, dropout_p=p, mask_key=key, blocks="auto" if fused else "explicit")
    got.backward(shard_sequence(grad, 2, cp, r))
    context_parallel._fused_forward = fused_forward
    kernel = "explicit" if p > 0 or not fused else "fused"
    if bool(calls) != (kernel == "fused"):
        raise AssertionError(f"ring attention dropout={p} fused={fused}: the fused kernel ran {len(calls)} times")
    tag = f"ring attention cp={cp} dropout={p} ({kernel} blocks): output and dq, dk, dv"
    check(tag, relative_error(got, shard_sequence(want, 2, cp, r)), worst)
    for _name, x, ref in zip("qkv", local, full):
        check(tag, relative_error(x.grad, shard_sequence(ref.grad, 2, cp, r)), worst)


def errors(backend: str) -> dict[str, float]:
    """{case: largest error over all ranks}: relative errors, or for a bitwise case the absolute difference."""
    # Tiles of 3 query rows: chunks of 4 and 8 tokens are cut into uneven tiles whose causal masks start
    # mid-chunk, chunks of 1 and 2 tokens fit one tile (ROW_TILE is 1024 in training).
    context_parallel.ROW_TILE = 3
    assert dist.get_world_size() == 4
    worst: dict = {}
    layouts = [dict(cp=4), dict(cp=2), dict(tp=2, cp=2)] if backend == "torch" else [dict(cp=2)]
    for layout in layouts:
        ctx = ParallelContext.build(**layout)
        for flavour in FLAVOURS:
            for mode in ("ring", "ulysses"):
                compare(ctx, flavour, mode, backend, worst)
        if layout == dict(cp=2) and backend == "torch":
            for mode in ("ring", "ulysses"):
                dropout_reproduces(ctx, mode, worst)
        if backend == "torch" and ctx.tp_size == 1:
            for p, fused in ((0.0, True), (0.0, False), (0.25, True)):
                ring_matches_masked_attention(ctx, worst, p, fused)
    return worst_over_ranks(worst)
