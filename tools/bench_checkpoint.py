"""How long a checkpoint save stalls training: synchronous vs checkpoint.async_save, side by side in one run.

    python tools/bench_checkpoint.py                       # gpt2-350m states on this machine (CPU: fp32)
    python tools/bench_checkpoint.py --model tiny --saves 2 --out /tmp/ckpt.json    # a quick check

One process builds the model and the DeepSpeed engine the trainer uses (zero.stage=0, AdamW: parameters plus two
moments, fp32 on CPU), takes one training step so the optimizer state exists, then saves `--saves` times each
way, alternating: the synchronous save (write, fsync, checksum, commit) and the asynchronous one (stage to host
memory, then write in a background thread). Per save it reports the time the loop was blocked and, for the
asynchronous one, the background write time; then the time to load the checkpoint back, and what a resume at
another layout adds (the conversion to the universal form, and the load from it, checked exact). The first
asynchronous save allocates the staging buffers (later saves reuse them), so the median is of `--saves` >= 3.
The issue's target: blocking <= 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite import checkpoint  # noqa: E402
from megatron_lite.checkpoint.store import read_meta, step_name  # noqa: E402
from megatron_lite.checkpoint.writer import AsyncWriter  # noqa: E402
from megatron_lite.cli import compose_config  # noqa: E402
from megatron_lite.engine import Engine  # noqa: E402
from megatron_lite.engine.ds_config import deepspeed_config  # noqa: E402
from megatron_lite.layout import Layout  # noqa: E402
from megatron_lite.model.build import build_model  # noqa: E402
from megatron_lite.parallel.context import ParallelContext, init_distributed  # noqa: E402
from tools.commit import git_commit  # noqa: E402


def state_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def convert_and_reload(engine, path: str) -> tuple[float, float]:
    """What resuming this ZeRO-0 checkpoint at another layout costs (checkpoint/universal.py, engine/repairs/universal_load.py): the conversion to the
    universal form, then loading every parameter and moment from it, here into the same layout, so the states
    must come back exactly (checked). Returns (conversion seconds, load seconds)."""
    from megatron_lite.checkpoint.universal import convert_to_universal
    from megatron_lite.engine.repairs.universal_load import _load_zero0_universal

    optimizer = engine.optimizer
    before = [t.clone() for t in _states(engine)]
    t0 = time.perf_counter()
    universal = convert_to_universal(path)
    convert_s = time.perf_counter() - t0
    with torch.no_grad():
        for t in _states(engine):
            t.zero_()
    t0 = time.perf_counter()
    _load_zero0_universal(engine, os.path.join(universal, "zero"))
    load_s = time.perf_counter() - t0
    assert all(torch.equal(a, b) for a, b in zip(before, _states(engine))), "the universal form changed a state"
    assert len(before) == 3 * sum(len(g["params"]) for g in optimizer.param_groups)
    return convert_s, load_s


def _states(engine) -> list[torch.Tensor]:
    """Every parameter and its two AdamW moments, in the optimizer's order."""
    state = engine.optimizer.state
    return [
        t
        for g in engine.optimizer.param_groups
        for p in g["params"]
        for t in (p, state[p]["exp_avg"], state[p]["exp_avg_sq"])
    ]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-350m")
    ap.add_argument("--saves", type=int, default=3, help="saves of each kind, alternating")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.saves < 1:
        ap.error(f"--saves {args.saves} must be >= 1")
    from omegaconf import OmegaConf

    from megatron_lite.errors import ConfigError

    try:
        cfg = OmegaConf.to_object(
            compose_config(
                [
                    f"model={args.model}",
                    "model.seq_len=128",
                    "train.micro_batch_size=1",
                    "train.global_batch_size=1",
                    "logging.wandb.mode=disabled",
                ]
            )
        )
    except ConfigError as err:
        ap.error(str(err))
    init_distributed()
    ctx = ParallelContext.build()
    layout = Layout.of_run(cfg, ctx.world_size)
    engine = Engine(
        build_model(cfg, ctx, layout), ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train
    )
    batch = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1), device=ctx.device)
    engine.train_step([batch], cfg.optim.lr, 1)  # the AdamW moments exist from here on
    meta = {
        "config": asdict(cfg),
        "layout": {
            "world_size": 1,
            "dp": 1,
            "tp": 1,
            "cp": 1,
            "cp_mode": "ring",
            "pp": 1,
            "vpp": 1,
            "zero_stage": cfg.zero.stage,
            "precision": "fp32",
            "layers_per_stage": [cfg.model.n_layers],
        },
    }
    root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    writer = AsyncWriter(ctx.rank, ctx.world_size, commit_timeout_s=3600, log=print)
    sync_s, block_s, write_s = [], [], []
    for i in range(args.saves):
        t0 = time.perf_counter()
        checkpoint.save(engine, ctx, root, 2 * i + 1, meta, keep=2)
        sync_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpoint.save_async(engine, ctx, root, 2 * i + 2, meta, 2, writer)
        block_s.append(time.perf_counter() - t0)
        write_s.append(writer.wait())
        print(
            f"save {i + 1}: synchronous {sync_s[-1]:.2f} s; asynchronous: loop blocked {block_s[-1]:.2f} s, "
            f"background write {write_s[-1]:.2f} s",
            flush=True,
        )
    last = os.path.join(root, step_name(2 * args.saves))
    size = state_bytes(last)
    t0 = time.perf_counter()
    checkpoint.load(engine, ctx, last, read_meta(last), Layout.of_run(cfg, ctx.world_size))
    load_s = time.perf_counter() - t0
    convert_s, universal_load_s = convert_and_reload(engine, last)
    record = {
        "bench": "checkpoint",
        "model": args.model,
        "state_gib": round(size / 2**30, 3),
        "sync_save_s": round(statistics.median(sync_s), 3),
        "async_block_s": round(statistics.median(block_s), 3),
        "async_block_first_s": round(block_s[0], 3),
        "sync_s": [round(t, 3) for t in sync_s],
        "async_block_each_s": [round(t, 3) for t in block_s],
        "async_write_each_s": [round(t, 3) for t in write_s],
        "async_write_s": round(statistics.median(write_s), 3),
        "load_s": round(load_s, 3),
        "universal_convert_s": round(convert_s, 3),
        "universal_load_s": round(universal_load_s, 3),
        "block_fraction": round(statistics.median(block_s) / statistics.median(sync_s), 4),
        "device": str(ctx.device),
        "threads": torch.get_num_threads(),
        "filesystem": root,
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
    }
    print(
        f"{args.model}: {record['state_gib']:.2f} GiB per checkpoint; synchronous save {record['sync_save_s']:.2f} s, "
        f"asynchronous blocks {record['async_block_s']:.2f} s ({100 * record['block_fraction']:.1f}% of it) and "
        f"writes {record['async_write_s']:.2f} s in the background; load {record['load_s']:.2f} s; for another "
        f"layout: conversion {record['universal_convert_s']:.2f} s, load {record['universal_load_s']:.2f} s"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    engine.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return record


if __name__ == "__main__":
    main()
