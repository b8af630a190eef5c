"""Training throughput: our single-process trainer (GPT + DeepSpeed engine) vs an HF GPT2LMHeadModel loop.

Same shape, batch, sequence length, precision, optimizer (AdamW) and clipping, in the same process; the sides
are timed in alternating blocks so that machine noise hits all alike. Prints tokens/s for each and the
ratio ours / HF, and optionally writes a JSON record (device, date, commit) for bench/results/.

A third side, plain, runs *our* model (same config and weights) in a plain PyTorch loop (fused AdamW, the clip,
autocast as the engine's): ours / plain is what the engine and the pipeline executor cost over the model alone.
At a small shape the step is host-bound, so that ratio is their host work per step (what a host-bound GPU step,
gpt2-124m or small micro-batches, pays), e.g. `--model tiny --micro-batch 1 --seq-len 16`.

    python tools/bench_throughput.py --model tiny --steps 20
    python tools/bench_throughput.py --model gpt2-124m --micro-batch 8 --seq-len 1024 --precision bf16 \
        --out bench/results/throughput_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.cli import compose_config  # noqa: E402
from megatron_lite.engine import Engine  # noqa: E402
from megatron_lite.engine.ds_config import deepspeed_config  # noqa: E402
from megatron_lite.layout import Layout  # noqa: E402
from megatron_lite.model.gpt import GPT  # noqa: E402
from megatron_lite.parallel.context import ParallelContext, init_distributed  # noqa: E402
from tools.commit import git_commit  # noqa: E402


def hf_gpt2(model_cfg, device, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=model_cfg.vocab_size,
        n_positions=model_cfg.seq_len,
        n_embd=model_cfg.d_model,
        n_layer=model_cfg.n_layers,
        n_head=model_cfg.n_heads,
        n_inner=model_cfg.ffn,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_new",
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(hf_cfg).to(device=device, dtype=dtype)


def loop_step(model, loss_of, opt, clip, autocast):
    """One step of a plain PyTorch training loop: loss_of() under autocast, backward, clip, AdamW."""
    with autocast():
        loss = loss_of()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def timed(fn, steps: int, device) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="model preset (a GPT-2-style one: HF side is GPT2LMHeadModel)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's seq_len")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating timed blocks per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="append a JSON record to this file")
    args = ap.parse_args(argv)
    if (
        min(args.micro_batch, args.steps, args.blocks) < 1
        or args.warmup < 0
        or (args.seq_len is not None and args.seq_len < 1)
    ):
        ap.error("--micro-batch, --steps, --blocks and --seq-len must be >= 1, --warmup >= 0")

    overrides = [
        f"model={args.model}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.precision={args.precision}",
        "model.dropout=0.0",
        "logging.wandb.mode=disabled",
    ]
    if args.seq_len:
        overrides.append(f"model.seq_len={args.seq_len}")
    from omegaconf import OmegaConf

    from megatron_lite.errors import ConfigError
    from megatron_lite.validation import validate

    try:
        cfg = OmegaConf.to_object(compose_config(overrides))
        validate(cfg, 1)  # the model shape and batch, before any process group
    except ConfigError as err:
        ap.error(str(err))
    init_distributed()
    ctx = ParallelContext.build()
    device = ctx.device
    torch.manual_seed(0)
    layout = Layout.of_run(cfg, ctx.world_size)
    engine = Engine(GPT(cfg.model), ctx, layout, deepspeed_config(cfg, layout), model_cfg=cfg.model, train=cfg.train)
    dtype = engine.dtype
    hf = hf_gpt2(cfg.model, device, torch.float32)
    hf_opt = torch.optim.AdamW(
        hf.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay
    )

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    plain = GPT(cfg.model).to(device)  # the same weights (each parameter drawn from its name and the seed)
    plain_opt = torch.optim.AdamW(
        plain.parameters(),
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=True,
    )

    seq = cfg.model.seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, seq + 1), device=device)
    clip = cfg.train.grad_clip
    sides = {
        "ours": lambda: engine.train_step([batch], cfg.optim.lr, 1),
        # HF shifts the labels itself
        "hf": lambda: loop_step(
            hf, lambda: hf(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss, hf_opt, clip, autocast
        ),
        "plain": lambda: loop_step(plain, lambda: plain(batch[:, :-1], batch[:, 1:]), plain_opt, clip, autocast).item(),
    }  # the engine's step reads its loss too
    times = {name: [] for name in sides}
    for step in sides.values():
        timed(step, args.warmup, device)
    for _ in range(args.blocks):
        for name, step in sides.items():
            times[name] += timed(step, args.steps, device)
    tokens = args.micro_batch * seq
    ours_tps, hf_tps, plain_tps = (tokens / statistics.median(times[name]) for name in sides)
    record = {
        "bench": "throughput",
        "model": args.model,
        "micro_batch": args.micro_batch,
        "seq_len": seq,
        "precision": str(dtype).replace("torch.", ""),
        "ours_tokens_per_s": round(ours_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "ratio": round(ours_tps / hf_tps, 3),
        "plain_tokens_per_s": round(plain_tps, 1),
        "ratio_vs_plain": round(ours_tps / plain_tps, 3),
        "step_ms": {name: round(1e3 * statistics.median(t), 3) for name, t in times.items()},
        "hf_side": "GPT2LMHeadModel sdpa eager" + (" + bf16 autocast" if dtype == torch.bfloat16 else ""),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads",
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "torch": torch.__version__,
    }
    print(
        f"{args.model} {record['precision']} b={args.micro_batch} s={seq}: ours {ours_tps:,.0f} tok/s, "
        f"HF {hf_tps:,.0f} tok/s, ratio {record['ratio']:.3f}x; our model in a plain loop {plain_tps:,.0f} tok/s, "
        f"ours / plain {record['ratio_vs_plain']:.3f}x (steps {record['step_ms']} ms)"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    engine.close()
    return record


if __name__ == "__main__":
    main()
