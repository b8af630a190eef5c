"""A run's layout as one frozen value: how its ranks split the work (dp, tp, cp, pp, vpp and the layers of
each virtual stage), the pipeline schedule, the ZeRO stage and the precision its states are held in, and the
batch split into micro-batches. Built once per run from a config and the ranks (`Layout.of_run`, which resolves
train.precision and parallel.schedule; the model build, the Engine and the checkpoint loaders take it from there,
none of them derives it again) or read back from a checkpoint's meta.json
(`Layout.of_checkpoint`, older checkpoints' missing keys taking the values they had then), it answers the
questions a resume asks: is this the layout the checkpoint was written with (then every rank continues its
own RNG streams), and does loading need DeepSpeed's universal conversion (another number of ZeRO partitions,
TP size, stage or pipeline layout). (The planner's plan/layout.Layout is a layout *to choose*, with the
memory and batch options it prices; this one is the layout a run *has*.)"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megatron_lite.pipeline.partition import layers_per_stage
from megatron_lite.pipeline.schedules import resolve_schedule, v_shaped


def resolve_precision(precision: str) -> str:
    """train.precision as a run has it: `auto` is bf16 where CUDA is, fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return precision


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    tp: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    pp: int = 1
    vpp: int = 1
    zero_stage: int = 0
    precision: str | None = None  # as resolved: fp32 or bf16 (None: a checkpoint older than the bf16 fixes)
    layers_per_stage: tuple[int, ...] = ()  # every virtual stage's layer count, in stage order
    v_shape: bool = False  # the virtual stages sit in a V (parallel.schedule=zbv), not in loops (partition.py)
    global_batch_size: int = 0
    micro_batch_size: int = 0
    schedule: str | None = None  # as resolved: gpipe, 1f1b, interleaved, zb_h1 or zbv (None: an older checkpoint)

    @classmethod
    def of_run(cls, cfg, world_size: int) -> Layout:
        """This job's layout: cfg's parallel/zero/train keys on world_size ranks, its precision and pipeline
        schedule resolved (train.precision=auto, parallel.schedule=auto)."""
        p, t = cfg.parallel, cfg.train
        schedule = resolve_schedule(p.schedule, p.vpp)
        return cls(
            world_size=world_size,
            dp=world_size // (p.tp * p.cp * p.pp),
            tp=p.tp,
            cp=p.cp,
            cp_mode=p.cp_mode,
            pp=p.pp,
            vpp=p.vpp,
            zero_stage=cfg.zero.stage,
            precision=resolve_precision(t.precision),
            layers_per_stage=tuple(layers_per_stage(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers)),
            v_shape=v_shaped(schedule),
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            schedule=schedule,
        )

    @classmethod
    def of_checkpoint(cls, meta: dict) -> Layout:
        """The layout a checkpoint was written with, from its meta.json (its `layout`, and its config's batch)."""
        saved, train = meta["layout"], meta.get("config", {}).get("train", {})
        return cls(
            world_size=saved["world_size"],
            dp=saved["dp"],
            tp=saved.get("tp", 1),
            cp=saved.get("cp", 1),
            cp_mode=saved.get("cp_mode", "ring"),
            pp=saved.get("pp", 1),
            vpp=saved.get("vpp", 1),
            zero_stage=saved["zero_stage"],
            precision=saved.get("precision"),
            layers_per_stage=tuple(saved.get("layers_per_stage") or ()),
            v_shape=saved.get("v_shape", False),
            global_batch_size=train.get("global_batch_size", 0),
            micro_batch_size=train.get("micro_batch_size", 0),
            schedule=saved.get("schedule"),
        )

    def to_meta(self) -> dict:
        """meta.json's `layout` (the batch lives in its `config`)."""
        out = asdict(self)
        del out["global_batch_size"], out["micro_batch_size"]
        return dict(out, layers_per_stage=list(self.layers_per_stage))

    @property
    def accumulation(self) -> int:
        """Micro-batches each pipeline runs per step: global batch / (micro-batch x dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def zero_partitions(self) -> int:
        """How many ranks ZeRO splits the states over: dp x cp (the parameters are replicated over cp)."""
        return self.dp * self.cp

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
