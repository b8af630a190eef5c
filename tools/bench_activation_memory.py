"""Activation memory per transformer layer, measured with saved-tensor hooks, vs Korthikanti et al. 2022.

    python tools/bench_activation_memory.py            # 2 gloo ranks (tp=2): sp off/on x recompute none/selective/full
    python tools/bench_activation_memory.py --out bench/results/activation_memory_cpu.json

Every tensor autograd saves for backward is recorded once (deduplicated by storage), parameters excluded,
for models of 2 and 3 layers; the difference is one layer's activations. Bytes are counted in the paper's "fp16 terms": 2 bytes per floating-point
element, 1 byte per boolean (dropout mask) element. The paper's per-layer bytes (its eq. 2 and §4.2):
    TP:       s*b*h * (10 + 24/t + 5*a*s/(h*t))
    TP + SP:  s*b*h * (34/t + 5*a*s/(h*t))
    + selective recomputation: the 5*a*s/(h*t) term (scores, softmax, dropout mask) is gone
    full recomputation:        2*s*b*h, only the layer input (2*s*b*h/t under SP, a sequence shard)
The model runs with dropout 0.1, so CPU SDPA takes its math path and materialises the score matrix as the
paper assumes (flash-style kernels would store a per-row statistic instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def saved_bytes(model, tokens) -> float:
    """Bytes (fp16 terms) autograd keeps for backward over model.hidden_states, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0.0]

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.untyped_storage().data_ptr() not in params and key not in seen:
            seen.add(key)
            total[0] += t.numel() * (1 if t.dtype == torch.bool else 2)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.hidden_states(tokens)
    hidden.float().sum().backward()
    return total[0]


def paper_factor(sp: bool, recompute: str, t: int, scores: float) -> float:
    """Korthikanti et al. Table 2, bytes per layer / (s*b*h). Full recomputation keeps the layer input
    (2 bytes per element), a sequence shard under SP."""
    if recompute == "full":
        return 2 / t if sp else 2
    base = 34 / t if sp else 10 + 24 / t
    return base + (scores if recompute == "none" else 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={args.tp}",
            __file__,
            *(argv or sys.argv[1:]),
        ]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))

    from megatron_lite.config import ModelConfig
    from megatron_lite.model.gpt import GPT
    from megatron_lite.model.parallelize import parallelize

    dist.init_process_group("gloo")
    t, rank = dist.get_world_size(), dist.get_rank()
    b, s, h, a = 4, 256, 256, 8
    cfg = ModelConfig(n_layers=2, n_heads=a, d_model=h, vocab_size=1024, seq_len=s, dropout=0.1)
    tokens = torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(0))
    rows = []
    for sp in (False, True):
        for recompute in ("none", "selective", "full"):
            saved = []
            for n_layers in (2, 3):  # one more layer adds exactly one layer's activations
                torch.manual_seed(0)
                model = GPT(dataclasses.replace(cfg, n_layers=n_layers), tp=t)
                model = parallelize(model, dist.group.WORLD, sp).train()
                model.set_recompute(recompute)
                saved.append(saved_bytes(model, tokens))
            measured = saved[1] - saved[0]
            paper = s * b * h * paper_factor(sp, recompute, t, 5 * a * s / (h * t))
            rows.append(
                {
                    "case": f"tp={t} sp={sp} recompute={recompute}",
                    "measured_bytes": measured,
                    "paper_bytes": paper,
                    "ratio": round(measured / paper, 3),
                }
            )
    if rank == 0:
        print(f"b={b} s={s} h={h} a={a} t={t}, dropout 0.1, per layer, fp16 terms")
        for r in rows:
            print(
                f"{r['case']:<36} measured {r['measured_bytes'] / 2**20:7.3f} MiB   paper "
                f"{r['paper_bytes'] / 2**20:7.3f} MiB   ratio {r['ratio']:.3f}"
            )
        if args.out:
            from tools.commit import git_commit

            with open(args.out, "w") as f:
                json.dump(
                    {
                        "bench": "activation_memory",
                        "b": b,
                        "s": s,
                        "h": h,
                        "a": a,
                        "dropout": 0.1,
                        "rows": rows,
                        "attention": "torch SDPA; with dropout on CPU it takes the math path, which saves the "
                        "s^2 scores, probabilities and mask (the paper's 5as/(ht) term)",
                        "device": "CPU (gloo)",
                        "date": datetime.date.today().isoformat(),
                        "commit": git_commit(),
                    },
                    f,
                    indent=1,
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_lite.cli import exit_process

    exit_process(main)  # a gloo rank ends without the interpreter's teardown: exit_process says why
