"""parallel.*: the rank grid (tp, cp, pp over the world), context parallelism and the pipeline."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.pipeline.partition import layers_per_stage
from megatron_lite.pipeline.schedules import SCHEDULE_CHOICES, SPLIT_BACKWARD, resolve_schedule
from megatron_lite.validation.rules import choice, divisors, fail


def check_grid(cfg: Config, world_size: int) -> None:
    """tp, pp, vpp and cp against the world size and the model's heads, FFN width and sequence."""
    m, p = cfg.model, cfg.parallel
    for key in ("tp", "pp", "vpp", "cp"):
        if getattr(p, key) < 1:
            fail(f"parallel.{key}", getattr(p, key), "must be >= 1", "use 1 to disable")
    if world_size % (p.tp * p.cp * p.pp):
        key, val = next(((f"parallel.{k}", v) for k, v in (("pp", p.pp), ("cp", p.cp)) if v > 1), ("parallel.tp", p.tp))
        fail(
            key,
            val,
            f"makes tp*cp*pp={p.tp * p.cp * p.pp} (tp={p.tp}, cp={p.cp}, pp={p.pp}), which must divide the "
            f"world size {world_size}",
            f"pick tp*cp*pp among {divisors(world_size)}",
        )
    for key, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads), ("model.ffn_hidden", m.ffn)):
        if val % p.tp:
            # KV heads are split, never replicated, so tp must divide them too (see model/parallelize.py).
            fail("parallel.tp", p.tp, f"must divide {key}={val}", f"try {divisors(val)}")
    if p.sp and m.seq_len % p.tp:
        fail(
            "parallel.sp",
            p.sp,
            f"needs parallel.tp={p.tp} to divide model.seq_len={m.seq_len}",
            "change model.seq_len or parallel.tp",
        )


def check_context_parallel(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel

    def fits_world(c: int) -> bool:  # a suggested cp must also leave tp*cp*pp dividing the world size
        return world_size % (p.tp * c * p.pp) == 0

    choice("parallel.cp_mode", p.cp_mode, ("ring", "ulysses"))
    if p.cp == 1:
        return
    # The load-balanced causal split cuts the sequence into 2*cp equal chunks; SP then splits a rank's share over tp.
    chunks = 2 * p.cp * (p.tp if p.sp else 1)
    if m.seq_len % chunks:
        what = f"2*cp*tp={chunks} (with parallel.sp)" if p.sp and p.tp > 1 else f"2*cp={chunks}"
        fit = [c for c in range(1, m.seq_len + 1) if m.seq_len % (2 * c * (p.tp if p.sp else 1)) == 0 and fits_world(c)]
        fail(
            "parallel.cp",
            p.cp,
            f"needs {what} to divide model.seq_len={m.seq_len} (each rank holds two of 2*cp equal chunks)",
            f"use parallel.cp in {fit or [1]} or change model.seq_len",
        )
    if p.cp_mode == "ulysses":
        for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads)):
            local = heads // p.tp
            if local % p.cp:
                fit = [
                    c
                    for c in range(1, local + 1)
                    if (m.n_heads // p.tp) % c == 0 and (m.kv_heads // p.tp) % c == 0 and fits_world(c)
                ]
                fail(
                    "parallel.cp",
                    p.cp,
                    f"with parallel.cp_mode=ulysses must divide the {key.split('.')[1]} per "
                    f"TP rank ({key}={heads} / parallel.tp={p.tp} = {local})",
                    f"use parallel.cp in {fit}, or parallel.cp_mode=ring (any head count)",
                )
    if cfg.train.compile:
        fail(
            "train.compile",
            True,
            f"does not work with parallel.cp={p.cp} (the attention's ring or all-to-all "
            "would break every compiled block's graph)",
            "use train.compile=false or parallel.cp=1",
        )


def check_pipeline(cfg: Config, dp: int) -> None:
    m, p, z, t = cfg.model, cfg.parallel, cfg.zero, cfg.train
    choice("parallel.schedule", p.schedule, SCHEDULE_CHOICES)
    if p.schedule in SPLIT_BACKWARD:
        resolve_schedule(p.schedule, p.vpp)  # its own chunk count
        if p.pp == 1:
            fail(
                "parallel.schedule",
                p.schedule,
                "fills a pipeline's idle slots, and parallel.pp=1 has none",
                "use parallel.schedule=auto, or parallel.pp=2 or more",
            )
    if p.vpp > 1 and p.pp == 1:
        fail(
            "parallel.vpp",
            p.vpp,
            "needs parallel.pp > 1 (virtual stages interleave across pipeline ranks)",
            "set parallel.pp=2 or more, or parallel.vpp=1",
        )
    layers_per_stage(m.n_layers, p.pp, p.vpp, p.pp_layers)
    if p.pp == 1:
        return
    if z.stage == 3:
        fail(
            "zero.stage",
            3,
            f"does not compose with parallel.pp={p.pp} (ZeRO-3 would re-gather every chunk's "
            "parameters for every micro-batch)",
            "use zero.stage=1 or 2 with a pipeline, or parallel.pp=1",
        )
    micro = t.global_batch_size // (t.micro_batch_size * dp) if t.micro_batch_size * dp else 0
    if p.schedule != "gpipe" and 0 < micro < p.pp:
        fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"gives {micro} micro-batches per pipeline "
            f"(micro_batch_size={t.micro_batch_size} x dp={dp}), fewer than parallel.pp={p.pp}, which the "
            f"{resolve_schedule(p.schedule, p.vpp)} schedule needs (every one but gpipe)",
            f"use train.global_batch_size>={p.pp * t.micro_batch_size * dp} or parallel.schedule=gpipe",
        )
