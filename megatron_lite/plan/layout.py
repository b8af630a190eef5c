"""A layout as the planner sees it: every parallel, memory and batch choice of one run, as one frozen value.

`Layout.from_config` reads it off a Config and a world size; `overrides()` gives back the Hydra overrides
that run it. The planner enumerates these (plan/search.py) and prices them (plan/memory.py, plan/timing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.pipeline.schedules import resolve_schedule


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    sp: bool
    cp_mode: str
    schedule: str  # as resolved: gpipe, 1f1b, interleaved, zb_h1 or zbv
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    recompute: str
    recompute_every: int
    micro_batch_size: int
    global_batch_size: int
    pp_layers: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def accumulation(self) -> int:
        """Micro-batches per step on each pipeline (m)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        p, z, t = cfg.parallel, cfg.zero, cfg.train
        return cls(
            tp=p.tp,
            pp=p.pp,
            vpp=p.vpp,
            cp=p.cp,
            dp=world_size // (p.tp * p.cp * p.pp),
            sp=p.sp and p.tp > 1,
            cp_mode=p.cp_mode,
            schedule=resolve_schedule(p.schedule, p.vpp),
            zero_stage=z.stage,
            offload_optimizer=z.offload_optimizer,
            offload_param=z.offload_param,
            recompute=t.recompute,
            recompute_every=t.recompute_every,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            pp_layers=tuple(p.pp_layers) if p.pp_layers is not None else None,
        )

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
            "train.micro_batch_size": str(self.micro_batch_size),
            "train.recompute": self.recompute,
            "train.recompute_every": str(self.recompute_every),
        }

    def overrides(self) -> list[str]:
        """The Hydra overrides that select this layout (cluster and model keys left as they are)."""
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
        out.append(f"train.micro_batch_size={self.micro_batch_size}")
        out.append(f"train.global_batch_size={self.global_batch_size}")
        if self.recompute != "none":
            out.append(f"train.recompute={self.recompute}")
            if self.recompute == "full" and self.recompute_every > 1:
                out.append(f"train.recompute_every={self.recompute_every}")
        return out
