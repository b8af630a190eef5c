"""Ring attention's block kernels side by side: the fused kernel (CPU flash; on CUDA FlashAttention-2 for
fp16/bf16, else memory-efficient) against the explicit fp32 path, forward + backward of every cp rank, the ranks
run as threads of one process (so one device is enough: their work adds up on it, as the ring's compute would
on cp devices; no transfer is timed). Prints the time of each, the ratio, and how far the fused result is from
the explicit one (relative, output and gradients).

  python tools/bench_ring_blocks.py                       # CPU, small
  python tools/bench_ring_blocks.py --device cuda --dtype bf16 --seq 16384 --heads 16 --kv-heads 4 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.parallel.context_parallel import (  # noqa: E402
    RingCall,
    fused_kernel,
    ring_backward,
    ring_forward,
    shard_sequence,
)


class _Mailbox:
    def __init__(self):
        self.slots, self.cond = {}, threading.Condition()

    def put(self, key, x):
        with self.cond:
            self.slots[key] = x
            self.cond.notify_all()

    def take(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.slots, timeout=300):
                raise TimeoutError(f"nothing arrived for {key}")
            return self.slots.pop(key)


class ThreadRing:
    """context_parallel._Ring among threads of one process: the i-th post of rank r is what the i-th post of
    rank r + 1 receives (every rank posts the same sequence of blocks)."""

    def __init__(self, mailbox: _Mailbox, size: int, rank: int):
        self.mailbox, self.size, self.rank, self.sent = mailbox, size, rank, 0

    def post(self, x):
        self.mailbox.put(((self.rank + 1) % self.size, self.sent), x.clone())
        self.sent += 1
        return self.sent - 1

    def wait(self, seq):
        return self.mailbox.take((self.rank, seq))


def ring_in_threads(q, k, v, grad, cp: int, kernel: str | None, segments=None) -> list[tuple]:
    """Every cp rank's (output, dq, dk, dv) for the whole-sequence q, k, v and output gradient, by
    ring_forward/ring_backward run in cp threads over a ThreadRing (segments: each token's document, (b, s))."""
    mailbox, results, errors = _Mailbox(), [None] * cp, []

    def rank(r):
        try:
            call = RingCall(ThreadRing(mailbox, cp, r), kernel=kernel, segments=segments)
            local = [shard_sequence(x, 2, cp, r) for x in (q, k, v)]
            out, lse, aux = ring_forward(*local, call)
            results[r] = (out, *ring_backward(shard_sequence(grad, 2, cp, r), *local, out, lse, aux, call))
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    return results


def relative(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if min(args.cp, args.seq, args.batch, args.heads, args.kv_heads, args.head_dim, args.repeats) < 1:
        ap.error("--cp, --seq, --batch, --heads, --kv-heads, --head-dim and --repeats must be >= 1")
    if args.heads % args.kv_heads or args.seq % (2 * args.cp):
        ap.error(
            f"--kv-heads {args.kv_heads} must divide --heads {args.heads}, and 2 x --cp {args.cp} must divide "
            f"--seq {args.seq} (each rank holds two chunks)"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(args.batch, h, args.seq, args.head_dim, generator=g).to(args.device, dtype)
        for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
    )
    kernel = fused_kernel(q)
    times, results = {}, {}
    for name, kern in (("fused", kernel), ("explicit", None)):
        best = float("inf")
        for _ in range(args.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            results[name] = ring_in_threads(q, k, v, grad, args.cp, kern)
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    diffs = {
        part: max(relative(f[i], e[i]) for f, e in zip(results["fused"], results["explicit"]))
        for i, part in enumerate(("output", "dq", "dk", "dv"))
    }
    row = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "cp": args.cp,
        "seq": args.seq,
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "fused_kernel": kernel,
        "fused_s": times["fused"],
        "explicit_s": times["explicit"],
        "speedup": times["explicit"] / times["fused"],
        "fused_vs_explicit_relative": diffs,
    }
    print(
        f"ring blocks, {row['device']} {args.dtype}, cp {args.cp} (threads), b {args.batch} s {args.seq} heads "
        f"{args.heads}/{args.kv_heads} hd {args.head_dim}: fused ({kernel}) {times['fused'] * 1e3:.1f} ms, "
        f"explicit {times['explicit'] * 1e3:.1f} ms, {row['speedup']:.2f}x; fused vs explicit "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
