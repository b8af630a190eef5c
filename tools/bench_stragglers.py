"""What measuring each rank's busy time costs (faults/stragglers.py): training steps with the measurement on
against off, side by side in one process group, at a report every step (train.log_interval=1, the default and
the most it can cost). The target: under 1% of step time.

    python tools/bench_stragglers.py                      # tiny, 2 gloo ranks (torchrun), 60 steps each way
    python tools/bench_stragglers.py --ranks 4 --pairs 30 --out /tmp/stragglers.json model=gpt2-124m

Separate runs of the trainer differ by up to 30% in step time on a shared 2-core machine (start-up, placement),
and even blocks of 10 steps in one process by 20%: far more than what is measured here. So one world builds the
model and engine as the trainer does and alternates single steps, off (a plain step) and on (the collective
clock installed, the step's busy time taken, and the report's all-reduce of world-size floats, exactly as the
Trainer calls them each step at train.log_interval=1), and compares the medians of each side. It also times what
the on side adds directly (the clock's bookkeeping and the report, in ms a step), and counts the collective calls
a step makes, which the clock's per-call cost scales with. Overrides after the options go to the config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(pairs: int, overrides: list[str], out: str | None) -> None:
    import torch
    import torch.distributed as dist

    from megatron_lite.cli import load
    from megatron_lite.data.sampler import MicroBatches, open_streams
    from megatron_lite.engine import Engine
    from megatron_lite.engine.ds_config import deepspeed_config
    from megatron_lite.faults.stragglers import CollectiveClock, StragglerWatch
    from megatron_lite.layout import Layout
    from megatron_lite.model.build import build_model
    from megatron_lite.parallel.context import ParallelContext, init_distributed

    cfg = load(["logging.wandb.mode=disabled", *overrides])
    init_distributed(cfg.dist.timeout_s)
    ctx = ParallelContext.build(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp)
    layout = Layout.of_run(cfg, ctx.world_size)
    model = build_model(cfg, ctx, layout)
    engine = Engine(model, ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
    stream = open_streams(cfg.data.path, cfg.data.weights, cfg.model.seq_len, cfg.seed, validation=False).train
    batches = MicroBatches(stream, cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp_size)
    step = 0

    added = []  # seconds the on side's own calls take, each step

    def timed_step(watch: StragglerWatch | None) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        if watch is not None:
            watch.start_step()
        t1 = time.perf_counter()
        engine.train_step(batches.next_step(), 1e-4, step)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if watch is not None:
            watch.end_step(t2 - t1)
            watch.report()
            added.append(time.perf_counter() - t2 + t1 - t0)
        return time.perf_counter() - t0

    for _ in range(3):
        timed_step(None)  # warm-up
    calls = CollectiveClock(ctx.device)
    counted = {"n": 0}
    original_span = calls.span

    def counting_span():
        counted["n"] += 1
        return original_span()

    calls.span = counting_span
    calls.install()
    timed_step(None)
    calls.uninstall()
    times = {"off": [], "on": []}
    watch = StragglerWatch(cfg.faults, ctx.device)
    watch.close()  # installed only for its own steps
    for i in range(pairs):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            if side == "on":
                watch.clock.install()
            times[side].append(timed_step(watch if side == "on" else None))
            watch.clock.uninstall()
    engine.close()
    if ctx.is_rank0:
        off, on, extra = statistics.median(times["off"]), statistics.median(times["on"]), statistics.median(added)
        print(
            f"{ctx.world_size} ranks, {counted['n']} collective calls a step, {pairs} steps each way: step time off "
            f"{off * 1e3:.2f} ms, on {on * 1e3:.2f} ms (medians), on / off {on / off:.4f}; the measurement's own "
            f"calls {extra * 1e3:.3f} ms a step, {100 * extra / off:.3f}% of the step"
        )
        if out:
            figures = {"world": ctx.world_size, "calls_per_step": counted["n"], "overrides": overrides}
            figures.update(step_s=times, ratio=on / off, added_s=extra)
            with open(out, "w") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=60, help="steps each way")
    parser.add_argument("--out", help="write the figures as JSON here")
    args, overrides = parser.parse_known_args(argv)
    if "RANK" in os.environ:
        worker(args.pairs, overrides, args.out)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    cmd += [os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, WANDB_SILENT="true")).returncode


if __name__ == "__main__":
    sys.exit(main())
