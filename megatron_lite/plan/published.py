"""Published Megatron-LM results the planner is held against, and the systems that produced them.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1:
GPT models of 1.7B-1T parameters on 32-3,072 A100-80GB GPUs (DGX A100: 8 per node, NVLink 300 GB/s, 8 x 200 Gb/s
HDR InfiniBand), s = 2048, V = 51,200, fp16, full activation recomputation; throughput in their convention
96 B s l h² (1 + s/6h + V/16lh) FLOPs per step (recomputation included, attention not halved). Micro-batch sizes and
which runs interleave come from NVIDIA/Megatron-LM's examples/sc21/run_table_1.sh (commit de7dc40): the paper
says every run interleaves, the script passes virtual stages only for the 76B-530B rows, and we follow the script.
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Tables 3 and 5: 22B-1T on
8-512 of the same GPUs, tp 8, no data parallelism, selective recomputation with sequence parallelism, model FLOPs
utilisation in the convention 72 B s l h² (1 + s/6h + V/12lh) over 312 TFLOP/s; 175B and 530B interleaved.

The systems differ from megatron_lite in what the planner prices (plan/timing.py's System): their attention was
not fused (the s² scores go through HBM), gradients were all-reduced in fp16 after the backward without a ZeRO
all-gather, and pipeline messages were split over the TP ranks (scatter/gather). Memory is not compared: the
papers report none per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_lite.config import ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.plan.hardware import GPUS, Cluster
from megatron_lite.plan.timing import System

MEGATRON_2021 = System(
    name="Megatron-LM 2021",
    flash_attention=False,
    reduce_bytes=2,
    dp_overlap_stages=(),
    regather_sp=False,
    pp_scatter_gather=True,
    gathers_params=False,
    reduce_buckets=False,
)
# 2022 adds sequence parallelism, whose backward all-gather Megatron overlaps with the weight-gradient GEMM
MEGATRON_2022 = replace(MEGATRON_2021, name="Megatron-LM 2022")

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class PublishedRun:
    source: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    layers_per_virtual_stage: int | None
    recompute: str  # full (2021) or selective with SP (2022)
    published: float  # TFLOP/s per GPU (2021) or MFU (2022), in the paper's convention

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(
            name=f"gpt-{self.params_b:g}b",
            n_layers=self.layers,
            n_heads=self.heads,
            d_model=self.hidden,
            vocab_size=VOCAB,
            seq_len=SEQ,
        )

    @property
    def layout(self) -> Layout:
        """Their layout in our terms: ZeRO-1 holds fp16-style bf16 weights with fp32 master copies as Megatron's
        optimizer does (its partitioning over dp changes memory, not the time priced under their System)."""
        vpp = self.layers // self.pp // self.layers_per_virtual_stage if self.layers_per_virtual_stage else 1
        return Layout(
            tp=self.tp,
            pp=self.pp,
            vpp=vpp,
            cp=1,
            dp=self.gpus // (self.tp * self.pp),
            sp=self.recompute == "selective",
            cp_mode="ring",
            schedule="interleaved" if vpp > 1 else "1f1b",
            layers_per_stage=(self.layers // (self.pp * vpp),) * (self.pp * vpp),
            zero_stage=1,
            offload_optimizer="none",
            offload_param="none",
            precision="bf16",
            recompute=self.recompute,
            recompute_every=1,
            micro_batch_size=self.micro_batch,
            global_batch_size=self.batch,
        )

    @property
    def cluster(self) -> Cluster:
        return Cluster(
            gpu=GPUS["a100-80gb"],
            gpus_per_node=8,
            nodes=max(1, self.gpus // 8),
            intra_node_GBps=300,
            inter_node_GBps=200,
            achievable=0.65,
            reserve_bytes=2 * 2**30,
        )

    @property
    def system(self) -> System:
        return MEGATRON_2021 if self.recompute == "full" else MEGATRON_2022

    def flops_per_step(self) -> float:
        """FLOPs per step in the paper's own convention."""
        B, s, L, h, V = self.batch, SEQ, self.layers, self.hidden, VOCAB
        if self.recompute == "full":
            return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
        return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))

    def in_their_terms(self, step_s: float) -> float:
        """A step time as the paper reports it: TFLOP/s per GPU (2021), MFU over 312 TFLOP/s (2022)."""
        per_gpu = self.flops_per_step() / step_s / self.gpus
        return per_gpu / 1e12 if self.recompute == "full" else per_gpu / 312e12


def _n(p, a, h, L, tp, pp, gpus, batch, tflops, micro, lpv):
    return PublishedRun("Narayanan et al. 2021, Table 1", p, a, h, L, tp, pp, gpus, batch, micro, lpv, "full", tflops)


def _k(p, a, h, L, pp, gpus, batch, micro, lpv, mfu):
    return PublishedRun(
        "Korthikanti et al. 2022, Table 5", p, a, h, L, 8, pp, gpus, batch, micro, lpv, "selective", mfu
    )


NARAYANAN_2021 = [
    _n(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, None),
    _n(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, None),
    _n(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, None),
    _n(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None),
    _n(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None),
    _n(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    _n(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5),
    _n(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    _n(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
    _n(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None),
]

# "interleaved schedule with m = 3" for 175B and 530B: three virtual stages per rank
KORTHIKANTI_2022 = [
    _k(22, 64, 6144, 48, 1, 8, 4, 4, None, 0.415),
    _k(175, 96, 12288, 96, 8, 64, 64, 1, 4, 0.514),
    _k(530, 128, 20480, 105, 35, 280, 280, 1, 1, 0.560),
    _k(1000, 160, 25600, 128, 64, 512, 512, 1, None, 0.563),
]


def row(run: PublishedRun, pick: bool = True) -> dict:
    """Predicted vs published for one run, and (pick=True) the layout the planner picks for its model, batch and
    cluster, priced as megatron_lite would run it, next to their layout priced the same way."""
    from megatron_lite.plan import predict
    from megatron_lite.plan.search import search

    theirs = predict(run.model, run.layout, run.cluster, run.system)
    predicted = run.in_their_terms(theirs.step.total_s)
    out = {
        "source": run.source,
        "model": f"{run.params_b:g}B",
        "gpus": run.gpus,
        "layout": " ".join(run.layout.overrides()),
        "published": run.published,
        "predicted": predicted,
        "error": predicted / run.published - 1,
    }
    if pick:
        ours_at_theirs = predict(run.model, run.layout, run.cluster)
        best = search(run.model, run.batch, run.cluster)[0]
        out.update(
            ours_at_theirs_s=ours_at_theirs.step.total_s,
            ours_at_theirs_fits=ours_at_theirs.fits,
            picked=" ".join(best.layout.overrides()),
            picked_s=best.step.total_s,
            picked_tflops=best.tflops_per_gpu,
            picked_mfu=best.mfu,
            picked_gib=best.memory_bytes / 2**30,
        )
    return out
