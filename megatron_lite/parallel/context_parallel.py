"""Attention over a sequence split across the ranks of a context-parallel group: ring and Ulysses.

The split (load-balanced for causal attention): the sequence is cut into 2·cp equal chunks and cp rank r
holds chunks r and 2cp-1-r, in that order. Under a causal mask a late chunk attends to many keys and an early
one to few; pairing them gives every rank the same work (Megatron-Core's and Brandon et al. 2023's split).
Positions stay global: rank r's tokens have the position ids `cp_positions`, so learned positions and RoPE
rows are those of the whole sequence.

Ring (Liu et al. 2023, "Ring Attention"): each rank keeps its queries and passes its K/V block to the next rank
cp-1 times, so every query chunk meets every key chunk once. For a pair of chunks (query chunk i, key chunk j)
with global indices: j < i is unmasked, j == i is causal, j > i is skipped. Each pair gives a partial output
normalised by its own log-sum-exp; the partials merge exactly by log-sum-exp weights. The next block's
transfer is posted before the current block's compute, so the p2p hides behind it. Backward is a ring too:
the K/V blocks travel again with their dK/dV accumulators (fp32), which arrive home after cp steps. GQA: the
ring carries the K/V heads as they are (the saving GQA makes), expanded to the query heads per block.
A block (a pair of chunks) is computed by one of two kinds of kernel; neither makes a chunk x chunk score
matrix, and nothing s-squared is kept for backward (it recomputes each block's scores from q, k and the row
log-sum-exp):
  fused     without dropout: one of torch's fused attention kernels that return the block's log-sum-exp,
            and its backward called with the merged output and log-sum-exp, which gives exactly the
            block's share of dq, dk and dv (the softmax backward needs only those two row quantities):
            on CPU the flash kernel for CPU (fp32); on CUDA FlashAttention-2 for fp16/bf16 with a head
            dim of at most 256 (Ampere and later), else the memory-efficient kernel (fp32 too)
  explicit  with dropout (or when asked): fp32 matmuls and softmax, ROW_TILE query rows at a time.
            Attention-probability dropout draws one mask per tile, keyed by its chunk pair's global
            indices and first row, so ring and serial attention drop the same probabilities.

Documents (data.document_mask): a query sees only the keys of its own document. Every rank holds the whole
window's document index of each token (`segments`, non-decreasing along the window), so each block takes its
query rows' and key chunk's from it: a block whose keys all lie in documents before its queries' is skipped (in
forward and backward; `block_counts` counts them), one inside a single document needs no mask, and any other
gets a mask (an additive one for the CPU kernel; on CUDA such blocks run explicit, as FlashAttention-2 takes no
mask). A query row that sees no key of a block gets no weight in the merge. Ulysses gathers whole sequences,
so the block's SDPA takes the whole window's mask.

Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns the sequence shards of every head into
all of the sequence for cp-th of the heads; attention runs as the block's own SDPA (flash attention on a GPU);
a second all-to-all turns it back. It needs cp to divide the local query and K/V head counts (validation/parallel.py).

Trade-off: Ulysses moves 4 activations of s·h/cp elements per rank per layer in all-to-alls whose volume
does not grow with cp, and uses SDPA (flash attention on a GPU); ring moves K/V (2·s·h_kv/cp per step, cp-1
steps) in p2p that hides behind compute when a block is big enough, and has no head-count limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel.mappings import all_to_all
from megatron_lite.parallel.random import Key, keep_mask


def cp_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The global indices of the two chunks (of 2·cp) that cp rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global position ids of this rank's tokens of a sequence of seq_len."""
    c = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in cp_chunks(cp_size, cp_rank)])


def document_mask(q_segments: torch.Tensor, k_segments: torch.Tensor, causal_offset: int | None = 0) -> torch.Tensor:
    """SDPA's boolean mask (b, 1, sq, sk): key j is seen by query i when they share a document and, with a causal
    offset o, j <= i + o (o = 0 for a query and key range that start together)."""
    same = q_segments[:, None, :, None] == k_segments[:, None, None, :]
    if causal_offset is None:
        return same
    sq, sk = q_segments.shape[1], k_segments.shape[1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=same.device).tril(causal_offset)
    return same & causal


def shard_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's chunks of x along dim (the whole sequence)."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in cp_chunks(cp_size, cp_rank)], dim=dim).contiguous()


# ---- ring ----------------------------------------------------------------------------------------------------


class _Ring:
    """Passes a tensor one rank on around the cp group: post() sends ours and receives the previous rank's,
    wait() returns what arrived. (Anything with size, rank, post and wait can stand in for it in a RingCall:
    tests/unit/test_ring_blocks.py runs the ranks as threads of one process, on CPU or one GPU.)"""

    def __init__(self, group):
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.group = group

    def post(self, x: torch.Tensor):
        received = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return dist.batch_isend_irecv(ops), received, x  # x stays alive until the send is done

    @staticmethod
    def wait(pending) -> torch.Tensor:
        requests, received, _ = pending
        for request in requests:
            request.wait()
        return received


# Query rows per explicit block computation: the transient fp32 scores of one block are heads x ROW_TILE x
# chunk, not heads x chunk x chunk (for a 128k sequence at cp=8, chunks of 8k tokens: 32 MiB a head, not 256).
ROW_TILE = 1024

BLOCKS = ("auto", "fused", "explicit")


def fused_kernel(q: torch.Tensor) -> str | None:
    """The fused kernel that computes q's blocks: cpu (torch's flash kernel for CPU), flash (FlashAttention-2:
    CUDA, fp16/bf16, head dim a multiple of 8 up to 256, compute capability 8.0+), efficient (the
    memory-efficient kernel: CUDA, any float dtype, head dim a multiple of 8); None where none applies."""
    hd = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda" or hd % 8:
        return None
    if (
        q.dtype in (torch.float16, torch.bfloat16)
        and hd <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    ):
        return "flash"
    return "efficient"


def _block_kernel(q: torch.Tensor, dropout_p: float, blocks: str, documents: bool = False) -> str | None:
    """The fused kernel for this call's blocks, or None for the explicit path: auto takes the fused one
    without dropout, fused insists on it, explicit never uses it. With documents only the CPU kernel, which
    takes a mask, is fused."""
    if blocks not in BLOCKS:
        raise ValueError(f"blocks={blocks!r}: expected one of {', '.join(BLOCKS)}")
    kernel = fused_kernel(q) if blocks != "explicit" and dropout_p == 0 else None
    if documents and kernel != "cpu":
        kernel = None
    if blocks == "fused" and kernel is None:
        raise ValueError(
            f"blocks=fused: no fused kernel for {q.device.type} {q.dtype} head dim {q.shape[-1]} "
            f"with dropout {dropout_p}; use blocks=auto"
        )
    return kernel


def _blocks(cp: int, rank: int, source: int, chunk: int, tiled: bool):
    """What this rank computes while it holds `source`'s K/V block: (query half, key half, query rows, causal,
    the block's place), halves 0/1 being the local chunks. Key chunks after the query chunk are skipped, the
    diagonal one is causal; tiled cuts each pair into tiles of ROW_TILE query rows. The place (query chunk,
    key chunk, first row) keys the block's dropout mask."""
    step = ROW_TILE if tiled else chunk
    for qi, gq in enumerate(cp_chunks(cp, rank)):
        for ki, gk in enumerate(cp_chunks(cp, source)):
            if gk <= gq:
                for start in range(0, chunk, step):
                    yield qi, ki, slice(start, min(start + step, chunk)), gk == gq, (gq, gk, start)


def _additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean mask (True: seen) as the CPU kernel's fp32 additive one."""
    return None if mask is None else torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def _fused_forward(kernel: str, q, k, v, causal: bool, scale: float, mask=None):
    """One block by a fused kernel: (output, fp32 log-sum-exp with a trailing unit dim, what its backward
    needs from the forward besides the output and log-sum-exp). Equal-length query and key chunks, so a
    causal mask is the usual one on the diagonal block. mask (the CPU kernel only): a boolean (b, 1, rows, keys)
    that already holds the causal part; a row it hides wholly gets a log-sum-exp of -inf (the kernel says 0)."""
    aten = torch.ops.aten
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, causal and mask is None, attn_mask=_additive(mask), scale=scale
        )
        if mask is not None:
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse.unsqueeze(-1), None
    if kernel == "flash":  # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset, debug)
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse.unsqueeze(-1), tuple(rest[:6])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    # the kernel pads its log-sum-exp to a multiple of 32 rows; its backward wants that length back
    return out, lse[..., : q.shape[2]].unsqueeze(-1), (seed, offset, lse.shape[-1])


def _fused_backward(kernel: str, aux, grad_out, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """The block's dq, dk, dv given the merged output and log-sum-exp of its query rows."""
    aten, lse = torch.ops.aten, lse.squeeze(-1)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.float(),
            q.float(),
            k.float(),
            v.float(),
            out.float(),
            lse,
            0.0,
            causal and mask is None,
            attn_mask=_additive(mask),
            scale=scale,
        )
    grad_out, out = grad_out.to(q.dtype).contiguous(), out.to(q.dtype)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    seed, offset, padded = aux
    lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, first_row: int, mask=None) -> torch.Tensor:
    """fp32 q k^T · scale for query rows first_row... of a chunk against a key chunk; when causal (the same
    chunk), -inf where the key comes after the query; given a boolean mask (documents, causal part included),
    -inf where it hides the key."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    elif causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first_row), float("-inf"))
    return s


def _keep(
    mask_key: Key, place, tp_rank, rows: slice, like: torch.Tensor, chunk: int, dropout_p: float
) -> torch.Tensor | None:
    """The scaled dropout keep-mask of a tile (query rows x chunk keys of every head of `like`), None without
    dropout."""
    if dropout_p == 0:
        return None
    shape = (*like.shape[:2], rows.stop - rows.start, chunk)
    return keep_mask((*mask_key, *place), tp_rank, shape, dropout_p, like.device) / (1 - dropout_p)


def _explicit_forward(q, k, v, causal: bool, first_row: int, scale: float, keep, mask=None):
    """One tile of a block in fp32: (output, log-sum-exp with a trailing unit dim). A row that sees no key (only
    with documents) gets an output of 0 and a log-sum-exp of -inf."""
    s = _scores(q, k, scale, causal, first_row, mask)
    lse = s.logsumexp(-1, keepdim=True)  # finite without documents: every row sees at least its own key
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0))
    return torch.matmul(p if keep is None else p * keep, v.float()), lse


def _explicit_backward(do, q, k, v, lse, delta, causal: bool, first_row: int, scale: float, keep, mask=None):
    """One tile's dq, dk, dv (fp32) from the merged row log-sum-exp and delta = rowsum(dO ∘ O)."""
    q = q.float()
    p = torch.exp(_scores(q, k, scale, causal, first_row, mask) - lse)
    dz = torch.matmul(do, v.float().transpose(-1, -2))
    z, dp = (p, dz) if keep is None else (p * keep, dz * keep)
    ds = p * (dp - delta) * scale  # softmax backward over the whole row
    return torch.matmul(ds, k.float()), torch.matmul(ds.transpose(-1, -2), q), torch.matmul(z.transpose(-1, -2), do)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated to the query heads (GQA: query head h reads K/V head h // group)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _expand: sum over each K/V head's query group."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


@dataclass(frozen=True)
class RingCall:
    """What a ring attention call needs besides q, k and v: the ring, dropout (probability, mask key, tp rank)
    and the fused block kernel (None: explicit blocks)."""

    ring: object
    dropout_p: float = 0.0
    mask_key: Key = ()
    tp_rank: int | None = None
    kernel: str | None = None
    segments: torch.Tensor | None = None  # (b, s) the whole window's document index of each token (documents)


@dataclass
class BlockCounts:
    """Ring blocks (chunk pairs, or tiles of them on the explicit path) this process computed and skipped in
    forward passes since the last reset (a benchmark reads them: tools/bench_documents.py)."""

    computed: int = 0
    skipped: int = 0


block_counts = BlockCounts()


def _block_mask(call: RingCall, cp: int, gq: int, gk: int, rows: slice, causal: bool):
    """(skip, mask) of the block of query chunk gq's rows against key chunk gk: skip when every key lies in an
    earlier document than every query of every sample; mask None when no document is involved or when, in every
    sample, queries and keys lie in one document (then the causal flag alone is right)."""
    if call.segments is None:
        return False, None
    chunks = call.segments.chunk(2 * cp, dim=1)
    sq, sk = chunks[gq][:, rows], chunks[gk]  # (b, rows), (b, chunk): non-decreasing along each row
    if bool((sk[:, -1] < sq[:, 0]).all()):
        return True, None
    if bool((sk[:, 0] == sq[:, -1]).all()):
        return False, None
    return False, document_mask(sq, sk, rows.start if causal else None)


def ring_forward(q, k, v, call: RingCall):
    """The ring's forward on this rank: (output in q's dtype, fp32 row log-sum-exp (b, heads, 2c, 1), what a
    fused kernel's backward needs). Plain tensors, no autograd: _RingAttention wraps it (and tests run the
    ranks as threads, which autograd's one CUDA worker thread could not)."""
    ring, dropout_p, mask_key, tp_rank, kernel = call.ring, call.dropout_p, call.mask_key, call.tp_rank, call.kernel
    cp, rank = ring.size, ring.rank
    scale, heads, chunk = 1.0 / math.sqrt(q.shape[-1]), q.shape[1], q.shape[2] // 2
    qs = q.chunk(2, dim=2)
    # laid out (b, s, heads, hd) as a fused kernel lays its output: the output projection's input, in token order,
    # is then a view of what this function saves, not a second copy (GPT attention's transpose + reshape)
    b, _, s, d = q.shape
    out = torch.zeros(b, s, heads, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
    outs, lses = out.chunk(2, dim=2), lse.chunk(2, dim=2)  # views: the blocks update them in place
    kv, aux = torch.stack([k, v]), None
    for step in range(cp):
        source = (rank - step) % cp
        pending = ring.post(kv) if step < cp - 1 else None  # the next block travels during this compute
        ks, vs = (_expand(x, heads).chunk(2, dim=2) for x in kv)
        for qi, ki, rows, causal, place in _blocks(cp, rank, source, chunk, tiled=kernel is None):
            skip, mask = _block_mask(call, cp, place[0], place[1], rows, causal)
            block_counts.skipped += skip
            block_counts.computed += not skip
            if skip:
                continue
            if kernel is not None:
                block_out, block_lse, aux = _fused_forward(kernel, qs[qi], ks[ki], vs[ki], causal, scale, mask)
            else:
                keep = _keep(mask_key, place, tp_rank, rows, q, chunk, dropout_p)
                block_out, block_lse = _explicit_forward(
                    qs[qi][:, :, rows], ks[ki], vs[ki], causal, rows.start, scale, keep, mask
                )
            o, o_lse = outs[qi][:, :, rows], lses[qi][:, :, rows]
            merged = torch.logaddexp(o_lse, block_lse)
            # a row that has seen no key yet (documents only) is -inf on both sides: weigh both by 0, not nan
            finite = torch.where(torch.isfinite(merged), merged, 0.0)
            o.mul_(torch.exp(o_lse - finite)).add_(block_out * torch.exp(block_lse - finite))
            o_lse.copy_(merged)
        if pending is not None:
            kv = ring.wait(pending)
    return (
        out.to(q.dtype),
        lse,
        aux,
    )  # (to() keeps the layout); aux: the same for every block (equal chunks, no dropout)


def ring_backward(grad_out, q, k, v, out, lse, aux, call: RingCall):
    """The ring's backward on this rank: dq, dk, dv (in the dtypes of q, k, v) from ring_forward's results."""
    ring, dropout_p, kernel = call.ring, call.dropout_p, call.kernel
    cp, rank = ring.size, ring.rank
    scale, heads, kv_heads = 1.0 / math.sqrt(q.shape[-1]), q.shape[1], k.shape[1]
    chunk = q.shape[2] // 2
    do = grad_out if kernel is not None else grad_out.float()
    qs, dos, lses = q.chunk(2, dim=2), do.chunk(2, dim=2), lse.chunk(2, dim=2)
    if kernel is not None:  # the kernel takes the merged output and derives rowsum(dO ∘ O) itself
        outs = out.chunk(2, dim=2)
    else:  # rowsum(dO ∘ O), with dropout too
        deltas = (do * out.float()).sum(-1, keepdim=True).chunk(2, dim=2)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqs = dq.chunk(2, dim=2)
    kv, dkv_pending = torch.stack([k, v]), None
    for step in range(cp):
        source = (rank - step) % cp
        kv_pending = ring.post(kv) if step < cp - 1 else None
        ks, vs = (_expand(x, heads).chunk(2, dim=2) for x in kv)
        dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
        dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
        for qi, ki, rows, causal, place in _blocks(cp, rank, source, chunk, tiled=kernel is None):
            skip, mask = _block_mask(call, cp, place[0], place[1], rows, causal)
            if skip:
                continue
            if kernel is not None:
                grads = _fused_backward(
                    kernel, aux, dos[qi], qs[qi], ks[ki], vs[ki], outs[qi], lses[qi], causal, scale, mask
                )
            else:
                keep = _keep(call.mask_key, place, call.tp_rank, rows, q, chunk, dropout_p)
                grads = _explicit_backward(
                    dos[qi][:, :, rows],
                    qs[qi][:, :, rows],
                    ks[ki],
                    vs[ki],
                    lses[qi][:, :, rows],
                    deltas[qi][:, :, rows],
                    causal,
                    rows.start,
                    scale,
                    keep,
                    mask,
                )
            for acc, grad in zip((dqs[qi][:, :, rows], dks[ki], dvs[ki]), grads):
                acc += grad
        dkv = torch.stack([_fold(torch.cat(dks, dim=2), kv_heads), _fold(torch.cat(dvs, dim=2), kv_heads)])
        if dkv_pending is not None:  # what the ranks before us added to this block
            dkv += ring.wait(dkv_pending)
        dkv_pending = ring.post(dkv)  # on to the next holder; after cp steps it is home
        if kv_pending is not None:
            kv = ring.wait(kv_pending)
    dk, dv = ring.wait(dkv_pending)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: RingCall):
        out, lse, aux = ring_forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.aux = call, aux
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return *ring_backward(grad_out, *ctx.saved_tensors, ctx.aux, ctx.call), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group,
    *,
    dropout_p: float = 0.0,
    mask_key: Key = (),
    tp_rank: int | None = None,
    blocks: str = "auto",
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys: q (b, heads, 2c, hd),
    k and v (b, kv_heads, 2c, hd), each holding chunks cp_chunks(cp, rank). Dropout masks are keyed by
    mask_key + (query chunk, key chunk, first row of the tile) and tp_rank. blocks: auto (a fused kernel
    without dropout where one applies, see fused_kernel), fused, or explicit. segments (b, s): the whole
    window's document index of each token (data.document_mask): attention stays within documents."""
    kernel = _block_kernel(q, dropout_p, blocks, documents=segments is not None)
    call = RingCall(_Ring(cp_group), dropout_p, tuple(mask_key), tp_rank, kernel, segments)
    return _RingAttention.apply(q, k, v, call)


# ---- Ulysses -------------------------------------------------------------------------------------------------


def _natural_order(cp: int) -> list[int]:
    """Where each chunk of the natural order sits in the sequence gathered from the ranks (rank j's chunks
    j and 2cp-1-j, in rank order)."""
    gathered = [g for rank in range(cp) for g in cp_chunks(cp, rank)]
    return [gathered.index(g) for g in range(2 * cp)]


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.view(b, h, len(order), s // len(order), d)[:, :, order].reshape(b, h, s, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, core) -> torch.Tensor:
    """core(q, k, v) -> out, causal attention over a whole sequence in order, run on cp-th of the heads:
    q (b, heads, 2c, hd), k and v (b, kv_heads, 2c, hd) hold this rank's chunks of every head."""
    cp = dist.get_world_size(cp_group)
    to_natural = _natural_order(cp)
    to_gathered = [to_natural.index(i) for i in range(2 * cp)]
    # (b, heads, s/cp, hd) -> (b, heads/cp, s, hd): scatter the heads, gather the sequence
    q, k, v = (_reorder(all_to_all(x, cp_group, 1, 2), to_natural) for x in (q, k, v))
    y = core(q, k, v)
    return all_to_all(_reorder(y, to_gathered), cp_group, 2, 1)
