"""Every valid layout of a model and batch on a cluster, priced and ranked; and the cheapest fix for one that
does not fit.

The axes: tp (dividing the heads, KV heads and MLP width, and the GPUs of a node: a TP group within one), sequence parallelism with tp, cp
(2·cp dividing the sequence, at least 128 tokens per chunk; Ulysses where cp divides the heads per TP rank),
pp and vpp (an even split of the layers), dp = world / (tp·cp·pp), the micro-batch (dividing the global batch
per replica, at least pp micro-batches under 1F1B), ZeRO 0-3 (3 without a pipeline), recompute none /
selective / full. CPU offload is tried only for layouts that fit no other way. GPipe is left out (the same
bubble as 1F1B with every micro-batch in flight), as are uneven layer splits and recompute_every > 1 (the
user can still --check them). Every layout this yields passes validation.validate (tests/unit/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from megatron_lite.config import ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.plan import Prediction, predict, predict_memory
from megatron_lite.plan.hardware import Cluster
from megatron_lite.plan.timing import OURS, System

MIN_CP_CHUNK = 128  # tokens per cp chunk (each rank holds two)
MAX_MICRO_BATCH = 64


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Space:
    """What the search may vary (the defaults: everything it supports)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload: bool = False
    pinned: tuple[tuple[str, object], ...] = ()  # (Layout field, value) pairs every layout must have (--plan key=v)
    precision: str = "bf16"  # what every layout computes in (train.precision as resolved on a GPU), not varied
    fp8: str = "none"  # train.fp8, not varied

    def admits(self, layout: Layout) -> bool:
        return all(getattr(layout, name) == value for name, value in self.pinned)


# Layout keys the search does not vary (what it uses instead): --plan refuses them rather than ignore them
UNSEARCHED = {
    "parallel.schedule": "the schedule auto picks",
    "parallel.pp_layers": "even layer splits",
    "zero.offload_param": "no parameter offload",
    "train.recompute_every": "recompute_every 1",
    "zero.nvme_path": "no NVMe offload",
    "zero.hpz": "no hpZ",
    "zero.shard_size": "ZeRO over all dp ranks",
}
# `--plan` overrides that pin a searched knob: override key -> Layout field
PINNABLE = {
    "parallel.tp": "tp",
    "parallel.sp": "sp",
    "parallel.cp": "cp",
    "parallel.cp_mode": "cp_mode",
    "parallel.pp": "pp",
    "parallel.vpp": "vpp",
    "zero.stage": "zero_stage",
    "zero.offload_optimizer": "offload_optimizer",
    "train.micro_batch_size": "micro_batch_size",
    "train.recompute": "recompute",
}


def layouts(
    model: ModelConfig, global_batch: int, world: int, gpus_per_node: int, space: Space = Space()
) -> Iterator[Layout]:
    """Every layout of the search space for `world` ranks (see the module docstring)."""
    for tp, sp, cp, mode, pp, vpp, dp in splits(model, world, gpus_per_node):
        yield from _batched(model, global_batch, tp, sp, cp, mode, pp, vpp, dp, space)


def splits(model: ModelConfig, world: int, gpus_per_node: int) -> Iterator[tuple]:
    """(tp, sp, cp, cp_mode, pp, vpp, dp) of every way the model's shape lets `world` ranks split it."""
    h_q, h_kv, f, s, L = model.n_heads, model.kv_heads, model.ffn, model.seq_len, model.n_layers
    for tp in divisors(world):
        if gpus_per_node % tp or h_q % tp or h_kv % tp or f % tp:  # a TP group inside a node
            continue
        for sp in (False, True) if tp > 1 and s % tp == 0 else (False,):
            for cp in divisors(world // tp):
                chunks = 2 * cp * (tp if sp else 1)
                if cp > 1 and (s % chunks or s // (2 * cp) < MIN_CP_CHUNK):
                    continue
                modes = ("ring",) if cp == 1 else ("ring", "ulysses")
                for mode in modes:
                    if mode == "ulysses" and ((h_q // tp) % cp or (h_kv // tp) % cp):
                        continue
                    for pp in divisors(world // (tp * cp)):
                        if L % pp:
                            continue
                        dp = world // (tp * cp * pp)
                        vpps = [v for v in divisors(L // pp) if v <= 8] if pp > 1 else [1]
                        for vpp in vpps:
                            yield tp, sp, cp, mode, pp, vpp, dp


def _batched(model, global_batch, tp, sp, cp, mode, pp, vpp, dp, space) -> Iterator[Layout]:
    if global_batch % dp:
        return
    for micro in divisors(global_batch // dp):
        m = global_batch // (dp * micro)
        if micro > MAX_MICRO_BATCH or (pp > 1 and m < pp):
            continue
        for zero in space.zero_stages:
            if zero == 3 and pp > 1:
                continue
            offloads = ("none", "cpu") if space.offload and zero >= 1 else ("none",)
            for recompute in space.recompute:
                for offload in offloads:
                    layout = Layout(
                        tp=tp,
                        pp=pp,
                        vpp=vpp,
                        cp=cp,
                        dp=dp,
                        sp=sp,
                        cp_mode=mode,
                        schedule="interleaved" if vpp > 1 else "1f1b",
                        layers_per_stage=(model.n_layers // (pp * vpp),) * (pp * vpp),
                        zero_stage=zero,
                        offload_optimizer=offload,
                        offload_param="none",
                        precision=space.precision,
                        fp8=space.fp8,
                        recompute=recompute,
                        recompute_every=1,
                        micro_batch_size=micro,
                        global_batch_size=global_batch,
                    )
                    if space.admits(layout):
                        yield layout


def search(
    model: ModelConfig,
    global_batch: int,
    cluster: Cluster,
    system: System = OURS,
    space: Space = Space(),
) -> list[Prediction]:
    """Every layout that fits, fastest first; if none fits, also those with CPU offload; if still none, the
    layouts that do not fit, smallest memory first (each has .fits False). Time is priced only for layouts that
    fit (memory is the cheaper half), except when none does."""
    world = cluster.world_size
    found = [
        (lay, predict_memory(model, lay)) for lay in layouts(model, global_batch, world, cluster.gpus_per_node, space)
    ]
    usable = cluster.usable_bytes
    fitting = [(lay, ranks) for lay, ranks in found if max(r.peak for r in ranks) <= usable]
    if not fitting and not space.offload:
        found += [
            (lay, predict_memory(model, lay))
            for lay in layouts(
                model,
                global_batch,
                world,
                cluster.gpus_per_node,
                replace(space, offload=True),
            )
            if lay.offload_optimizer != "none"
        ]
        fitting = [(lay, ranks) for lay, ranks in found if max(r.peak for r in ranks) <= usable]
    if fitting:
        return sorted(
            (predict(model, lay, cluster, system, ranks=ranks) for lay, ranks in fitting),
            key=lambda p: p.step.total_s,
        )
    smallest = sorted(found, key=lambda item: max(r.peak for r in item[1]))[:20]
    return [predict(model, lay, cluster, system, ranks=ranks) for lay, ranks in smallest]


def why_none(model: ModelConfig, global_batch: int, world: int, gpus_per_node: int, space: Space = Space()) -> str:
    """Why search found no layout of `world` ranks: the pinned knobs, or the batch (tp = cp = pp = 1 always
    splits the model, so some data-parallel sizes exist; none divides the batch or leaves a pipeline enough
    micro-batches)."""
    if space.pinned and any(True for _ in layouts(model, global_batch, world, gpus_per_node)):
        pins = " ".join(
            f"{key}={_typed(value)}" for key, name in PINNABLE.items() for field, value in space.pinned if field == name
        )
        return f"no layout of {world} GPUs has {pins}; pin fewer settings, or none to rank every layout"
    dps = sorted({dp for *_, dp in splits(model, world, gpus_per_node)})
    return (
        f"no layout of {world} GPUs takes train.global_batch_size={global_batch}: each data-parallel replica "
        f"takes whole micro-batches (a pipeline at least pp of them), and this model's shape allows dp in "
        f"{dps} here; use train.global_batch_size={-(-global_batch // world) * world}, or another number of GPUs"
    )


def _typed(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def fixes(
    model: ModelConfig, layout: Layout, cluster: Cluster, system: System = OURS
) -> list[tuple[list[str], Prediction]]:
    """Changes of one or two knobs that make `layout` fit (in its precision), fastest first, as (the overrides,
    the prediction)."""
    world, out = layout.world_size, []
    candidates = [
        lay
        for lay in layouts(
            model,
            layout.global_batch_size,
            world,
            cluster.gpus_per_node,
            Space(offload=True, precision=layout.precision, fp8=layout.fp8),
        )
        if _distance(lay, layout) <= 2
    ]
    for lay in candidates:
        pred = predict(model, lay, cluster, system)
        if pred.fits:
            out.append((_changed(layout, lay), pred))
    return sorted(out, key=lambda item: item[1].step.total_s)


def _distance(a: Layout, b: Layout) -> int:
    return len(_changed(a, b))


def _changed(old: Layout, new: Layout) -> list[str]:
    """The overrides that turn `old` into `new`: every setting that differs, a return to a default included (the
    search's layouts use the schedule auto picks, even layer splits, recompute_every 1, no parameter offload).
    The executor runs the schedule at pp=1 too (GPipe there still holds every micro-batch), so it counts."""
    mine, theirs = old.settings(), new.settings()
    changed = {k: v for k, v in theirs.items() if mine[k] != v}
    if new.cp == 1:  # settings that mean nothing in the new layout, where the old value is valid too
        changed.pop("parallel.cp_mode", None)
    if new.recompute != "full":
        changed.pop("train.recompute_every", None)
    return [f"{k}={v}" for k, v in changed.items()]
