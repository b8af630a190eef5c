"""A run's layout as one frozen value: how its ranks split the work (dp, tp + sp, cp, pp, vpp and the layers of
each virtual stage), the pipeline schedule, the ZeRO stage, offload and precision of its states, what it
recomputes, and the batch split into micro-batches.

One value serves the run and the planner: a layout the planner ranks (plan/search.py builds them field by field)
is the layout a run of its `overrides()` then has. A run builds it once, at the command line, from the config
and the world size (`Layout.of_run`, which resolves train.precision and parallel.schedule and splits the layers
over the stages); the model build, the Engine, DeepSpeed's config and the checkpoints take it from there and none
derives it again. Read back from a checkpoint's meta.json (`Layout.of_checkpoint`, an older checkpoint's missing
keys taking the values they had then), it answers the questions a resume asks: is this the layout the
checkpoint was written with (then every rank continues its own RNG streams), and does loading need DeepSpeed's
universal conversion (another number of ZeRO partitions, TP size, stage or pipeline layout)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megatron_lite.pipeline.partition import layers_per_stage
from megatron_lite.pipeline.schedules import resolve_schedule, v_shaped


def resolve_precision(precision: str, cuda: bool | None = None) -> str:
    """train.precision as a run has it: `auto` is bf16 on a GPU (cuda: whether there is one, by default this
    machine's answer; the planner plans for the cluster's GPUs), fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if (torch.cuda.is_available() if cuda is None else cuda) else "fp32"
    return precision


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    pp: int = 1
    vpp: int = 1
    sp: bool = False  # sequence parallelism, which only tp > 1 has
    schedule: str | None = None  # as resolved: gpipe, 1f1b, interleaved, zb_h1 or zbv (None: an older checkpoint)
    layers_per_stage: tuple[int, ...] = ()  # every virtual stage's layer count, in stage order
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    hpz: int = 1  # ZeRO++ hpZ's secondary-shard group size (1: off); the primary shards, which a checkpoint holds,
    # do not depend on it
    shard_size: int | None = None  # zero.shard_size: dp ranks per ZeRO partition group (None: all dp, one replica)
    precision: str | None = None  # as resolved: fp32 or bf16 (None: a checkpoint older than the bf16 fixes)
    recompute: str = "none"
    recompute_every: int = 1
    fp8: str = "none"  # train.fp8: the blocks' projections in float8 (none, tensorwise or rowwise)
    global_batch_size: int = 0
    micro_batch_size: int = 0

    @classmethod
    def of_run(cls, cfg, world_size: int, cuda: bool | None = None) -> Layout:
        """cfg's parallel/zero/train keys on world_size ranks, precision and pipeline schedule resolved
        (train.precision=auto, parallel.schedule=auto); cuda as resolve_precision's (the planner's True)."""
        p, z, t = cfg.parallel, cfg.zero, cfg.train
        return cls(
            dp=world_size // (p.tp * p.cp * p.pp),
            tp=p.tp,
            cp=p.cp,
            cp_mode=p.cp_mode,
            pp=p.pp,
            vpp=p.vpp,
            sp=p.sp and p.tp > 1,
            schedule=resolve_schedule(p.schedule, p.vpp),
            layers_per_stage=tuple(layers_per_stage(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers)),
            zero_stage=z.stage,
            offload_optimizer=z.offload_optimizer,
            offload_param=z.offload_param,
            hpz=z.hpz,
            shard_size=None if z.shard_size in (None, world_size // (p.tp * p.cp * p.pp)) else z.shard_size,
            precision=resolve_precision(t.precision, cuda),
            recompute=t.recompute,
            recompute_every=t.recompute_every,
            fp8=t.fp8,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
        )

    @classmethod
    def of_checkpoint(cls, meta: dict) -> Layout:
        """The layout a checkpoint was written with, from its meta.json (its `layout`, and its config's batch)."""
        saved, train = meta["layout"], meta.get("config", {}).get("train", {})
        known = {
            k: saved[k]
            for k in (
                "sp",
                "offload_optimizer",
                "offload_param",
                "hpz",
                "shard_size",
                "recompute",
                "recompute_every",
                "fp8",
            )
            if k in saved
        }
        return cls(
            dp=saved["dp"],
            tp=saved.get("tp", 1),
            cp=saved.get("cp", 1),
            cp_mode=saved.get("cp_mode", "ring"),
            pp=saved.get("pp", 1),
            vpp=saved.get("vpp", 1),
            # before the schedule was recorded, only whether its stages sat in a V was
            schedule=saved.get("schedule") or ("zbv" if saved.get("v_shape") else None),
            layers_per_stage=tuple(saved.get("layers_per_stage") or ()),
            zero_stage=saved["zero_stage"],
            precision=saved.get("precision"),
            global_batch_size=train.get("global_batch_size", 0),
            micro_batch_size=train.get("micro_batch_size", 0),
            **known,
        )

    def to_meta(self) -> dict:
        """meta.json's `layout` (the batch lives in its `config`)."""
        out = asdict(self)
        del out["global_batch_size"], out["micro_batch_size"]
        return dict(out, world_size=self.world_size, v_shape=self.v_shape, layers_per_stage=list(self.layers_per_stage))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def v_shape(self) -> bool:
        """Whether the virtual stages sit in a V (parallel.schedule=zbv), not in loops (pipeline/partition.py)."""
        return self.schedule is not None and v_shaped(self.schedule)

    @property
    def pp_layers(self) -> tuple[int, ...] | None:
        """parallel.pp_layers as it selects this split: None for the even one."""
        return None if len(set(self.layers_per_stage)) <= 1 else self.layers_per_stage

    @property
    def accumulation(self) -> int:
        """Micro-batches each pipeline runs per step (m): global batch / (micro-batch x dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def zero_dp(self) -> int:
        """The data-parallel ranks of one ZeRO partition group: zero.shard_size, or all of dp."""
        return self.shard_size or self.dp

    @property
    def replicas(self) -> int:
        """How many copies of the ZeRO states the data-parallel ranks hold (zero.shard_size: dp / shard_size)."""
        return self.dp // self.zero_dp

    @property
    def zero_partitions(self) -> int:
        """How many ranks ZeRO splits the states over: zero_dp x cp (the parameters are replicated over cp, and
        over the replicas of hybrid sharding)."""
        return self.zero_dp * self.cp

    @property
    def pipeline(self) -> tuple:
        """(pp, vpp, layers per virtual stage); () for the layers when nothing is split into stages."""
        return self.pp, self.vpp, self.layers_per_stage if self.pp * self.vpp > 1 else ()

    def same_as(self, saved: Layout) -> bool:
        """Whether `saved` has this whole layout: world, dp, tp, cp, pipeline (and its V) and ZeRO stage."""
        return (saved.world_size, saved.dp, saved.tp, saved.cp, saved.zero_stage, saved.pipeline, saved.v_shape) == (
            self.world_size,
            self.dp,
            self.tp,
            self.cp,
            self.zero_stage,
            self.pipeline,
            self.v_shape,
        )

    @property
    def bf16_states(self) -> bool | None:
        """Whether DeepSpeed holds this layout's states in its bf16 format (engine/ds_config.holds_bf16); None
        when the precision is not known (a checkpoint older than the bf16 fixes)."""
        from megatron_lite.engine.ds_config import holds_bf16  # (the engine imports this module)

        return None if self.precision is None else holds_bf16(self.precision, self.zero_stage)

    def needs_conversion(self, saved: Layout) -> bool:
        """Whether a ZeRO checkpoint written at `saved` loads here only through the universal format: another
        number of ZeRO partitions, TP size, stage or pipeline layout (a V holds other stages on each rank than
        loops do), or states held in the other of DeepSpeed's formats (bf16 parameters beside fp32 masters, or
        fp32 ones). From ZeRO-0 to ZeRO-0 only another TP size or pipeline layout converts: its optimizer state
        is whole on every DP rank, and fp32 in either precision."""
        if saved.zero_stage == self.zero_stage == 0:
            return (saved.pipeline, saved.v_shape, saved.tp) != (self.pipeline, self.v_shape, self.tp)
        formats = None not in (saved.bf16_states, self.bf16_states) and saved.bf16_states != self.bf16_states
        return formats or (saved.pipeline, saved.v_shape, saved.zero_partitions, saved.tp, saved.zero_stage) != (
            self.pipeline,
            self.v_shape,
            self.zero_partitions,
            self.tp,
            self.zero_stage,
        )

    # --- as the planner reports a layout ---

    def settings(self) -> dict[str, str]:
        """Every setting of this layout as override key -> value, defaults included (what a fix must name when
        it changes one back to its default)."""
        layers = "null" if self.pp_layers is None else "[" + ",".join(map(str, self.pp_layers)) + "]"
        return {
            "parallel.tp": str(self.tp),
            "parallel.sp": str(self.sp).lower(),
            "parallel.cp": str(self.cp),
            "parallel.cp_mode": self.cp_mode,
            "parallel.pp": str(self.pp),
            "parallel.vpp": str(self.vpp),
            "parallel.schedule": "auto" if self.schedule == resolve_schedule("auto", self.vpp) else self.schedule,
            "parallel.pp_layers": layers,
            "zero.stage": str(self.zero_stage),
            "zero.offload_optimizer": self.offload_optimizer,
            "zero.offload_param": self.offload_param,
            "zero.hpz": str(self.hpz),
            "zero.shard_size": "null" if self.shard_size is None else str(self.shard_size),
            "train.micro_batch_size": str(self.micro_batch_size),
            "train.recompute": self.recompute,
            "train.recompute_every": str(self.recompute_every),
        }

    def overrides(self) -> list[str]:
        """The Hydra overrides that select this layout (cluster, model and precision keys left as they are)."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}"]
        if self.vpp > 1:
            out.append(f"parallel.vpp={self.vpp}")
        if self.sp:
            out.append("parallel.sp=true")
        if self.cp > 1:
            out += [f"parallel.cp={self.cp}", f"parallel.cp_mode={self.cp_mode}"]
        if self.pp > 1 and self.schedule in ("gpipe", "zb_h1", "zbv"):  # not what auto picks
            out.append(f"parallel.schedule={self.schedule}")
        if self.pp_layers is not None:
            out.append("parallel.pp_layers=[" + ",".join(map(str, self.pp_layers)) + "]")
        out.append(f"zero.stage={self.zero_stage}")
        if self.offload_optimizer != "none":
            out.append(f"zero.offload_optimizer={self.offload_optimizer}")
        if self.offload_param != "none":
            out.append(f"zero.offload_param={self.offload_param}")
        if self.hpz > 1:
            out.append(f"zero.hpz={self.hpz}")
        if self.shard_size is not None:
            out.append(f"zero.shard_size={self.shard_size}")
        out.append(f"train.micro_batch_size={self.micro_batch_size}")
        out.append(f"train.global_batch_size={self.global_batch_size}")
        if self.recompute != "none":
            out.append(f"train.recompute={self.recompute}")
            if self.recompute == "full" and self.recompute_every > 1:
                out.append(f"train.recompute_every={self.recompute_every}")
        if self.fp8 != "none":
            out.append(f"train.fp8={self.fp8}")
        return out
