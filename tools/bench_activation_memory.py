"""Activation memory per transformer layer, measured with saved-tensor hooks, vs Korthikanti et al. 2022.

    python tools/bench_activation_memory.py            # starts 2 gloo ranks itself (tp=2), sp off and on
    python tools/bench_activation_memory.py --out bench/results/activation_memory_cpu.json

Every tensor autograd saves for backward inside the transformer blocks is recorded once (deduplicated by
storage), parameters excluded, and counted in the paper's "fp16 terms": 2 bytes per floating-point
element, 1 byte per boolean (dropout mask) element. The paper's per-layer bytes (its eq. 2 and §4.2):
    TP:       s*b*h * (10 + 24/t + 5*a*s/(h*t))
    TP + SP:  s*b*h * (34/t + 5*a*s/(h*t))
The 5*a*s/(h*t) term is the attention score matrix, softmax and its dropout mask; attention kernels that
never materialise it (flash-style SDPA, also on CPU) store a per-row statistic instead, so the measurement
is also shown against the formula without that term.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def saved_bytes_per_layer(model, tokens, params: set[int]) -> float:
    """Bytes (fp16 terms) that autograd saves inside the transformer blocks, per block."""
    seen, total, inside = set(), [0.0], [False]

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if inside[0] and t.untyped_storage().data_ptr() not in params and key not in seen:
            seen.add(key)
            total[0] += t.numel() * (1 if t.dtype == torch.bool else 2)
        return t

    for block in model.blocks:  # count only what is saved between a block's entry and exit
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.hidden_states(tokens)
    hidden.float().sum().backward()
    return total[0] / len(model.blocks)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp}", __file__,
               *(argv or sys.argv[1:])]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))

    from megatron_lite.config import ModelConfig
    from megatron_lite.model.gpt import GPT
    from megatron_lite.parallel.random import TPRNGTracker
    from megatron_lite.parallel.tensor_parallel import parallelize

    dist.init_process_group("gloo")
    t, rank = dist.get_world_size(), dist.get_rank()
    b, s, h, a = 4, 256, 256, 8
    cfg = ModelConfig(n_layers=2, n_heads=a, d_model=h, vocab_size=1024, seq_len=s, dropout=0.1)
    tokens = torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(0))
    rows = []
    for sp in (False, True):
        torch.manual_seed(0)
        model = parallelize(GPT(cfg, tp=t), dist.group.WORLD, sp, TPRNGTracker(0, rank, torch.device("cpu"))).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        measured = saved_bytes_per_layer(model, tokens, params)
        core = 5 * a * s / (h * t)
        paper = s * b * h * ((34 / t if sp else 10 + 24 / t) + core)
        no_scores = s * b * h * (34 / t if sp else 10 + 24 / t)
        rows.append({"case": f"tp={t} sp={sp}", "measured_bytes": measured, "paper_bytes": paper,
                     "ratio": round(measured / paper, 3), "paper_without_score_matrix": no_scores,
                     "ratio_without_score_matrix": round(measured / no_scores, 3)})
    if rank == 0:
        print(f"b={b} s={s} h={h} a={a} t={t}, per layer, fp16 terms")
        for r in rows:
            print(f"{r['case']:<16} measured {r['measured_bytes'] / 2**20:7.2f} MiB   paper {r['paper_bytes'] / 2**20:7.2f} "
                  f"MiB (ratio {r['ratio']:.3f})   paper without the s^2 term {r['paper_without_score_matrix'] / 2**20:7.2f}"
                  f" MiB (ratio {r['ratio_without_score_matrix']:.3f})")
        if args.out:
            from tools.bench_throughput import git_commit

            with open(args.out, "w") as f:
                json.dump({"bench": "activation_memory", "b": b, "s": s, "h": h, "a": a, "rows": rows,
                           "attention": "torch SDPA (CPU flash kernel: no s^2 matrix saved)", "device": "CPU (gloo)",
                           "date": datetime.date.today().isoformat(), "commit": git_commit()}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
