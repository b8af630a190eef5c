"""data.document_mask's cost, side by side with plain causal attention in the same run.

  python tools/bench_documents.py                        # CPU: seq 1024, documents of 128 tokens on average
  python tools/bench_documents.py --device cuda --dtype bf16 --batch 8   # (tools/bench_gpu.py runs this)

Three measurements, each the best of --repeats after a warm-up:
  1. attention alone, forward + backward, at a GPT-2-small head layout: causal SDPA against the document mask
     as the model computes it (CUDA bf16: the variable-length FlashAttention kernel; else SDPA with the
     block-diagonal causal mask) and, for the record, one SDPA call per document;
  2. a whole training step (forward + backward) of a small GPT, with the mask and without;
  3. ring attention (cp 2 and 4, ranks as threads): the blocks computed and the blocks skipped because they lie
     wholly across documents, per window (batch 1) and for the batch (a block is skipped when it is in every window).
Document lengths are drawn from a geometric distribution with the given mean (the windows of a packed stream
cut documents at their edges, as the data does). Prints the ratios; --out writes the record (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.data.documents import Windows  # noqa: E402
from megatron_lite.model.documents import DocumentMask, varlen_applies, varlen_attention  # noqa: E402
from megatron_lite.model.gpt import GPT  # noqa: E402
from megatron_lite.parallel import context_parallel as C  # noqa: E402
from megatron_lite.parallel.context_parallel import document_mask  # noqa: E402
from tools.bench_ring_blocks import ring_in_threads  # noqa: E402
from tools.commit import cpu_record  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def windows(batch: int, seq: int, mean: int, seed: int = 0) -> Windows:
    """batch windows of seq + 1 tokens cut from a stream of documents with geometric lengths of this mean."""
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / mean, size=4 * batch * (seq + 1) // mean + 16)
    stream = np.concatenate([np.arange(n) for n in lengths])[: batch * seq + 1]
    positions = np.stack([stream[i * seq : i * seq + seq + 1] for i in range(batch)])
    for row in positions:  # the part of a document begun in an earlier window counts from the window's start
        later = np.flatnonzero(row[1:] == 0)
        end = later[0] + 1 if len(later) else len(row)
        row[:end] = np.arange(end)
    tokens = rng.integers(1, 1000, size=positions.shape)
    return Windows(torch.from_numpy(tokens), torch.from_numpy(positions.astype(np.int64)))


def best_time(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def per_document(q, k, v, segments):
    """One causal SDPA call per document of each window."""
    outs = []
    for i in range(q.shape[0]):
        row = segments[i]
        starts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
        outs.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[i : i + 1, :, a:b], k[i : i + 1, :, a:b], v[i : i + 1, :, a:b], is_causal=True
                    )
                    for a, b in zip(starts[:-1], starts[1:])
                ],
                dim=2,
            )
        )
    return torch.cat(outs)


def attention_times(args, device, dtype, docs: DocumentMask) -> dict:
    b, s = docs.segments.shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, args.heads, s, args.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(3)
    )
    masked_name = "varlen" if varlen_applies(q) else "dense mask"

    def masked(q, k, v):
        if varlen_applies(q):
            return varlen_attention(q, k, v, docs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs.segments, docs.segments))

    cases = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        masked_name: masked,
        "per document": lambda q, k, v: per_document(q, k, v, docs.segments),
    }
    times = {}
    for name, fn in cases.items():
        times[name] = best_time(lambda fn=fn: fn(q, k, v).sum().backward(), args.repeats, device)
    return times


def step_times(args, device, dtype, batch: Windows) -> dict:
    s = batch.tokens.shape[1] - 1
    cfg = ModelConfig(n_layers=args.layers, n_heads=args.heads, d_model=args.heads * args.head_dim, vocab_size=1000,
                      seq_len=s)  # fmt: skip
    model = GPT(cfg, device=device).to(dtype)
    batch = batch.to(device)
    batch.loss_tokens = float(batch.predicted())
    inputs, labels = batch.tokens[:, :-1], batch.tokens[:, 1:]
    cases = {
        "causal": lambda: model(inputs, labels).backward(),
        "document mask": lambda: model(inputs, labels, documents=batch).backward(),
    }
    return {name: best_time(fn, args.repeats, device) for name, fn in cases.items()}


def ring_counts(args, docs: DocumentMask) -> dict:
    """Ring blocks computed and skipped (forward) at cp 2 and 4, for the first window alone and for the batch."""
    out = {}
    b, s = docs.segments.shape
    for cp in (2, 4):
        for rows, name in ((1, "one window"), (b, f"batch of {b}")):
            q = torch.randn(rows, 2, s, 16)
            C.block_counts.computed = C.block_counts.skipped = 0
            ring_in_threads(q, q, q, q, cp, "cpu", docs.segments[:rows].cpu())
            counts = C.block_counts  # every causal pair of chunks, over the cp ranks (one block each: fused)
            out[f"cp{cp}, {name}"] = {"skipped": counts.skipped, "of": counts.skipped + counts.computed}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--mean-doc", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the record (JSON) here")
    parser.add_argument("--quick", action="store_true", help="seq 256, 2 repeats: to check the tool")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.repeats, args.mean_doc = 256, 2, 32
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    batch = windows(args.batch, args.seq, args.mean_doc)
    docs = DocumentMask.of(batch.to(device))
    lengths = torch.diff(docs.packed[0]).double()
    print(f"{args.batch} windows of {args.seq} tokens: {len(lengths)} documents, mean length {lengths.mean():.0f}; "
          f"attention work {lengths.square().sum().item() / (args.batch * args.seq**2):.3f} of the causal window's")  # fmt: skip
    attention = attention_times(args, device, dtype, docs)
    step = step_times(args, device, dtype, batch)
    ring = ring_counts(args, docs) if device.type == "cpu" else None
    for what, times in (("attention fwd+bwd", attention), ("training step", step)):
        base = times["causal"]
        print(what + ": " + ", ".join(f"{name} {t * 1e3:.1f} ms ({t / base:.2f}x)" for name, t in times.items()))
    for name, counts in (ring or {}).items():
        print(f"ring {name}: {counts['skipped']} of {counts['of']} blocks skipped")
    record = cpu_record(
        "documents",
        config=vars(args),
        documents=len(lengths),
        mean_length=lengths.mean().item(),
        attention_share=lengths.square().sum().item() / (args.batch * args.seq**2),
        attention_ms={k: v * 1e3 for k, v in attention.items()},
        step_ms={k: v * 1e3 for k, v in step.items()},
        ring_blocks=ring,
    )
    if device.type == "cuda":
        record["device"] = torch.cuda.get_device_name(device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
