"""Context parallelism on CPU: activation bytes per rank, bytes per collective, overlap, and what fits.

    python tools/bench_context_parallel.py              # starts its own gloo ranks (torchrun), a few minutes
    python tools/bench_context_parallel.py --out bench/results/context_parallel_cpu.json

Model: Llama style (RoPE, RMSNorm, SwiGLU, GQA 4 query / 2 K/V heads), d_model 128, 2 layers, vocab 8192,
one sequence per micro-batch, fp32, dropout 0.

1. Activation bytes per rank against sequence length, cp in {1, 2, 4} (ring; Ulysses saves the same tensors
   outside attention): every tensor autograd keeps for backward over one forward with the loss, counted once
   (by storage), parameters excluded, in real bytes. Expected: proportional to 1/cp (the whole layer works on
   s/cp tokens, the logits included; no s x s tensor is kept: cp=1 runs torch's SDPA, which keeps a per-row
   statistic on CPU too, and the ring recomputes each block's scores in backward).
2. Bytes each rank sends per attention call (forward + backward), counted at dist.batch_isend_irecv (ring) and
   dist.all_to_all_single (Ulysses, the (cp-1)/cp of its input that leaves the rank), against the analytic
   volumes with b sequences, s tokens, hd head dim, hq / hkv query / K/V heads, e bytes per element:
       ring     forward   (cp-1) * 2*b*hkv*(s/cp)*hd*e           K and V, cp-1 hops
                backward  (cp-1) * 2*b*hkv*(s/cp)*hd*e           K and V again
                        +  cp    * 2*b*hkv*(s/cp)*hd*4           dK and dV (fp32 accumulators), home after cp hops
       ulysses  forward   (cp-1)/cp * b*(2*hq + 2*hkv)*(s/cp)*hd*e   q, k, v in, the output back
                backward  the same, reversed
3. Overlap (cp=2 in a world of its own, one rank per core): the ring's attention time T (forward + backward,
   blocks by the fused CPU kernel; the explicit block kernel's time alongside, as the baseline),
   its compute alone C (the same blocks with the p2p replaced by a local copy) and its p2p alone P (the same
   transfers with no compute). Hidden share of the p2p = (C + P - T) / P, clipped to [0, 1]. Ulysses cannot hide
   its all-to-alls (the attention needs their result): its exposed share is A / T with A the all-to-alls alone.
   Median of --repeats runs after a warm-up, the slower rank's.
4. What fits: one training step (forward, backward, AdamW step) at a sequence length where cp=1 exceeds a
   memory budget per process and cp=4 fits. The budget is enforced, not estimated: after the model and
   optimizer are built each process caps its data segment (RLIMIT_DATA, which on Linux counts anonymous
   memory: every CPU tensor) at what it holds then plus the budget; an allocation past it fails.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_model=128,
    vocab_size=8192,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    tie_embeddings=False,
    bias=False,
    dropout=0.0,
)
SEQ_LENS = (1024, 2048, 4096)
CPS = (1, 2, 4)
FIT_SEQ, FIT_BUDGET_MIB = 16384, 1024


def model_config(seq_len: int):
    from megatron_lite.config import ModelConfig

    return ModelConfig(**MODEL, seq_len=seq_len)


def build(ctx, seq_len: int, mode: str = "ring"):
    from megatron_lite.model.gpt import GPT
    from megatron_lite.model.parallelize_cp import cp_parallelize

    return cp_parallelize(GPT(model_config(seq_len), seed=1), ctx.cp_group, mode)


def tokens(seq_len: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(0))


def saved_bytes(model, x, y) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return total[0]


def activation_rows() -> list[dict]:
    from megatron_lite.parallel.context import ParallelContext

    rows = []
    for cp in CPS:
        ctx = ParallelContext.build(cp=cp)
        for s in SEQ_LENS:
            t = tokens(s)
            rows.append({"cp": cp, "seq_len": s, "bytes": saved_bytes(build(ctx, s), t[:, :-1], t[:, 1:])})
        dist.barrier()
    for row in rows:
        base = next(r["bytes"] for r in rows if r["cp"] == 1 and r["seq_len"] == row["seq_len"])
        row["vs_cp1"] = round(row["bytes"] / base, 3)
    return rows


class SentBytes:
    """Counts the bytes this rank sends through the two collectives context parallelism uses."""

    def __init__(self):
        self.bytes = 0
        self._p2p, self._a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def p2p(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return self._p2p(ops)

        def a2a(output, input, *args, group=None, **kwargs):
            n = dist.get_world_size(group)
            self.bytes += input.numel() * input.element_size() * (n - 1) // n
            return self._a2a(output, input, *args, group=group, **kwargs)

        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a

    def restore(self):
        dist.batch_isend_irecv, dist.all_to_all_single = self._p2p, self._a2a


def attention(mode: str, q, k, v, group, blocks: str = "auto"):
    from megatron_lite.parallel.context_parallel import ring_attention, ulysses_attention

    if mode == "ring":
        return ring_attention(q, k, v, group, blocks=blocks)
    return ulysses_attention(
        q, k, v, group, lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)
    )


def qkv(b: int, hq: int, hkv: int, s_local: int, hd: int):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(b, h, s_local, hd, generator=g).requires_grad_() for h in (hq, hkv, hkv)]


def analytic(mode: str, b, hq, hkv, s, hd, cp, e=4) -> dict:
    if mode == "ring":
        kv = 2 * b * hkv * (s // cp) * hd
        return {"forward": (cp - 1) * kv * e, "backward": (cp - 1) * kv * e + cp * kv * 4}
    per_call = (cp - 1) * b * (2 * hq + 2 * hkv) * (s // cp) * hd * e // cp
    return {"forward": per_call, "backward": per_call}


def volume_rows() -> list[dict]:
    from megatron_lite.parallel.context import ParallelContext

    b, hq, hkv, s, hd, rows = 1, 8, 4, 1024, 32, []  # Ulysses at cp=4 needs 4 | hkv
    for cp in (2, 4):
        ctx = ParallelContext.build(cp=cp)
        for mode in ("ring", "ulysses"):
            q, k, v = qkv(b, hq, hkv, s // cp, hd)
            counter = SentBytes()
            out = attention(mode, q, k, v, ctx.cp_group)
            forward = counter.bytes
            out.backward(torch.ones_like(out))
            backward = counter.bytes - forward
            counter.restore()
            want = analytic(mode, b, hq, hkv, s, hd, cp)
            rows.append(
                {
                    "mode": mode,
                    "cp": cp,
                    "b": b,
                    "hq": hq,
                    "hkv": hkv,
                    "s": s,
                    "hd": hd,
                    "forward": forward,
                    "forward_analytic": want["forward"],
                    "backward": backward,
                    "backward_analytic": want["backward"],
                }
            )
        dist.barrier()
    return rows


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overlap_rows(repeats: int) -> list[dict]:
    """cp=2: the whole (two-rank) world is the cp group."""
    from megatron_lite.parallel import context_parallel as C

    group, rows = dist.group.WORLD, []
    b, hq, hkv, hd = 1, 4, 2, 32
    for s in (2048, 4096):
        q, k, v = qkv(b, hq, hkv, s // 2, hd)

        def run(mode, blocks="auto"):
            def step():
                for x in (q, k, v):
                    x.grad = None
                attention(mode, q, k, v, group, blocks).backward(torch.ones_like(q))

            return step

        real_ring = C._Ring

        class LocalRing(real_ring):  # the same compute, each "transfer" a local copy
            def post(self, x):
                return [], x.clone(), x

        def p2p_only():  # the ring's transfers with no compute: cp-1 K/V hops forward, again backward,
            ring = real_ring(group)  # and cp dK/dV hops (fp32)
            kv = torch.stack([k, v]).detach()
            for _ in range(2):
                ring.wait(ring.post(kv))
            for _ in range(2):
                ring.wait(ring.post(kv.float()))

        def a2a_only():
            from megatron_lite.parallel.mappings import _all_to_all

            for x in (q, k, v, q):  # forward: q, k, v in, the output back; backward: the same
                _all_to_all(x.detach(), 1, 2, group)
                _all_to_all(x.detach(), 1, 2, group)

        t_ring = timed(run("ring"), repeats)
        C._Ring = LocalRing
        try:
            t_compute = timed(run("ring"), repeats)
        finally:
            C._Ring = real_ring
        t_explicit = timed(run("ring", "explicit"), repeats)
        t_p2p = timed(p2p_only, repeats)
        t_ulysses, t_a2a = timed(run("ulysses"), repeats), timed(a2a_only, repeats)
        times = torch.tensor([t_ring, t_compute, t_p2p, t_ulysses, t_a2a, t_explicit], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank's, as a step waits for it
        t_ring, t_compute, t_p2p, t_ulysses, t_a2a, t_explicit = times.tolist()
        hidden = min(1.0, max(0.0, (t_compute + t_p2p - t_ring) / t_p2p))
        rows.append(
            {
                "cp": 2,
                "s": s,
                "ring_ms": 1e3 * t_ring,
                "ring_compute_ms": 1e3 * t_compute,
                "ring_p2p_ms": 1e3 * t_p2p,
                "ring_hidden_share": round(hidden, 3),
                "ulysses_ms": 1e3 * t_ulysses,
                "ulysses_a2a_ms": 1e3 * t_a2a,
                "ulysses_exposed_share": round(t_a2a / t_ulysses, 3),
                "ring_explicit_blocks_ms": 1e3 * t_explicit,
            }
        )
    dist.barrier()
    return rows


def vm_data_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def fit_step(cp: int) -> dict:
    """One training step at FIT_SEQ under the budget; run in its own world of cp ranks."""
    from megatron_lite.parallel.context import ParallelContext

    ctx = ParallelContext.build(cp=cp)
    model = build(ctx, FIT_SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = tokens(FIT_SEQ)
    for p in model.parameters():  # the optimizer's state exists before the cap, as in a running job
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    before = vm_data_bytes()
    limit = before + FIT_BUDGET_MIB * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    try:
        loss = model(t[:, :-1], t[:, 1:])
        loss.backward()
        optimizer.step()
        outcome = "fits"
    except (RuntimeError, MemoryError) as e:
        outcome = f"does not fit ({str(e).splitlines()[0][:100]})"
    ok = torch.tensor([outcome == "fits"], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {
        "cp": cp,
        "seq_len": FIT_SEQ,
        "budget_mib": FIT_BUDGET_MIB,
        "outcome": outcome,
        "all_ranks_fit": bool(ok.item()),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def launch(nproc: int, argv: list[str]) -> int:
    from megatron_lite.parallel.context import free_port, torchrun_env

    # torchrun's scratch dirs go to a private TMPDIR and only this run's DeepSpeed buffers are removed, so a
    # shared machine's other jobs keep theirs.
    port, scratch = free_port(), tempfile.mkdtemp(prefix="bench_cp_")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={port}",
        __file__,
        *argv,
    ]
    env = torchrun_env(ROOT, TMPDIR=scratch)
    try:
        return subprocess.call(cmd, env=env, cwd=ROOT)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
            os.remove(path)


def report(record: dict) -> None:
    print(f"1. activation bytes per rank (saved for backward, one forward with the loss; {MODEL['n_layers']} layers)")
    print(f"{'seq_len':>8}" + "".join(f"{f'cp={cp} MiB':>12}{'vs cp=1':>9}" for cp in CPS))
    for s in SEQ_LENS:
        cells = [r for r in record["activations"] if r["seq_len"] == s]
        print(f"{s:>8}" + "".join(f"{r['bytes'] / 2**20:>12.1f}{r['vs_cp1']:>9.3f}" for r in cells))
    print("2. bytes sent per rank per attention call (measured / analytic)")
    for r in record["volumes"]:
        print(
            f"   {r['mode']:<8} cp={r['cp']} b={r['b']} s={r['s']} hq={r['hq']} hkv={r['hkv']} hd={r['hd']}: "
            f"forward {r['forward']:,} / {r['forward_analytic']:,}   "
            f"backward {r['backward']:,} / {r['backward_analytic']:,}"
        )
    print("3. overlap at cp=2 (ms, median)")
    for r in record["overlap"]:
        print(
            f"   s={r['s']}: ring {r['ring_ms']:.1f} = compute {r['ring_compute_ms']:.1f} + p2p "
            f"{r['ring_p2p_ms']:.1f} alone -> hidden share {r['ring_hidden_share']:.2f};  ulysses "
            f"{r['ulysses_ms']:.1f}, all-to-alls alone {r['ulysses_a2a_ms']:.1f} -> exposed "
            f"{r['ulysses_exposed_share']:.2f}"
        )
        print(
            f"          ring with explicit blocks {r['ring_explicit_blocks_ms']:.1f} -> the fused CPU kernel is "
            f"{r['ring_explicit_blocks_ms'] / r['ring_ms']:.1f}x faster"
        )
    print(f"4. one training step at seq_len {FIT_SEQ}, {FIT_BUDGET_MIB} MiB per process beyond model + optimizer")
    for r in record["fit"]:
        print(f"   cp={r['cp']}: {r['outcome']} (peak RSS {r['peak_rss_mib']:.0f} MiB)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON record (bench/results/...)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per overlap case, after one warm-up")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # for the ranks: main, overlap, fit1, fit4
    ap.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part is None:
        scratch = tempfile.mkdtemp(prefix="bench_cp_out_")
        parts = {}
        for part, nproc in (("main", 4), ("overlap", 2), ("fit1", 1), ("fit4", 4)):
            out = os.path.join(scratch, f"{part}.json")
            code = launch(nproc, ["--part", part, "--part-out", out, "--repeats", str(args.repeats)])
            if code != 0:
                sys.exit(f"bench part {part} failed (exit {code})")
            with open(out) as f:
                parts[part] = json.load(f)
        shutil.rmtree(scratch, ignore_errors=True)
        from tools.commit import git_commit

        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout)
        record = {
            "bench": "context_parallel",
            "date": datetime.date.today().isoformat(),
            "commit": git_commit(),
            "uncommitted_changes": dirty,
            "device": f"CPU ({os.cpu_count()} cores), gloo, fp32",
            "model": MODEL,
            **parts["main"],
            "overlap": parts["overlap"],
            "fit": [parts["fit1"], parts["fit4"]],
        }
        report(record)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        return

    from megatron_lite.parallel.context import init_distributed

    init_distributed()
    if args.part == "main":
        result = {"activations": activation_rows(), "volumes": volume_rows()}
    elif args.part == "overlap":
        result = overlap_rows(args.repeats)
    else:
        result = fit_step(int(args.part[3:]))
    if dist.get_rank() == 0:
        with open(args.part_out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
