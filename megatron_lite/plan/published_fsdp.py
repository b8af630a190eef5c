"""Published runs of fully sharded data parallelism (ZeRO-3-style) the planner is held against.

MosaicML, llm-foundry `scripts/train/benchmarking/README.md` (github.com/mosaicml/llm-foundry, read at commit
061f2c7): MPT models of 760M-70B trained with Composer's PyTorch FSDP (FULL_SHARD: parameters, gradients and
optimizer states sharded over every GPU), flash attention, with and without full activation checkpointing;
throughput as tokens per second per GPU. The rows kept here are the sequence-length-2048 rows of three tables:
  - "H100 80GB BF16": 8-64 GPUs, amp_bf16 with Composer's DEFAULT mixed precision (fp32 parameters, bf16 compute and
    gathers, fp32 gradient reduction); the nodes' network not stated, priced as an HGX H100 node's 8 x 400 Gb/s;
  - "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": 8-64 GPUs, amp_bf16 DEFAULT, but the 70B rows bf16
    PURE (gradients reduced in bf16);
  - "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": 8-128 GPUs, bf16 PURE.

The same stack on two GPU generations is what makes the A100 tables useful: the A100's rates were fitted to
Megatron-LM's runs (plan/published.py), not to these, so the A100 rows check the planner's ZeRO-3 model (gathers,
reduce-scatters over node boundaries, recomputation, what fits) on a stack whose kernels the rates describe.

The models, checked against the tables' parameter counts to the parameter: GPT-2-style blocks (LayerNorm with
bias, GeLU MLP of 4h, biases everywhere, learned positions, tied embeddings) with a 50,368-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.plan.hardware import GPUS, Cluster
from megatron_lite.plan.timing import System

SOURCE = "MosaicML llm-foundry, scripts/train/benchmarking/README.md (061f2c7)"
SEQ, VOCAB = 2048, 50368
# name -> (layers, heads, hidden)
MPT = {
    "760m": (24, 12, 1536),
    "1b": (24, 16, 2048),
    "3b": (32, 20, 2560),
    "7b": (32, 32, 4096),
    "13b": (40, 40, 5120),
    "30b": (48, 64, 7168),
    "70b": (80, 64, 8192),
}
# GPU -> (NVLink GB/s per direction, network GB/s per node): the H100 nodes' network is not stated (an HGX node's
# 8 x 400 Gb/s); the A100 tables' is 1600 Gb/s RoCE per node
NETWORK = {"h100-sxm": (450, 400), "a100-80gb": (300, 200), "a100-40gb": (300, 200)}


@dataclass(frozen=True)
class FsdpRun:
    model_name: str
    gpus: int
    micro_batch: int
    accumulation: int
    recompute: bool  # full activation checkpointing
    tokens_per_s_per_gpu: float  # published
    gpu: str = "h100-sxm"
    pure: bool = False  # Composer's PURE bf16: gradients reduced in bf16 (DEFAULT: fp32)

    @property
    def model(self) -> ModelConfig:
        layers, heads, hidden = MPT[self.model_name]
        return ModelConfig(
            name=f"mpt-{self.model_name}", n_layers=layers, n_heads=heads, d_model=hidden, vocab_size=VOCAB, seq_len=SEQ
        )

    @property
    def layout(self) -> Layout:
        return Layout(
            dp=self.gpus,
            schedule="1f1b",
            layers_per_stage=(MPT[self.model_name][0],),
            zero_stage=3,
            precision="bf16",
            recompute="full" if self.recompute else "none",
            micro_batch_size=self.micro_batch,
            global_batch_size=self.micro_batch * self.accumulation * self.gpus,
        )

    @property
    def cluster(self) -> Cluster:
        nvlink, network = NETWORK[self.gpu]
        return Cluster(
            gpu=GPUS[self.gpu],
            gpus_per_node=8,
            nodes=max(1, self.gpus // 8),
            intra_node_GBps=nvlink,
            inter_node_GBps=network,
            achievable=None,
            reserve_bytes=2 * 2**30,
        )

    @property
    def system(self) -> System:
        return System(
            name="Composer FSDP 2023", gathers_params=False, reduce_bytes=2 if self.pure else 4, fsdp_units=True
        )


def _h100(name, gpus, micro, accum, ac, tps):
    return FsdpRun(name, gpus, micro, accum, ac, tps)


def _a100_80(name, gpus, micro, accum, ac, tps):
    return FsdpRun(name, gpus, micro, accum, ac, tps, "a100-80gb", pure=name == "70b")


def _a100_40(name, gpus, micro, accum, ac, tps):
    return FsdpRun(name, gpus, micro, accum, ac, tps, "a100-40gb", pure=True)


MOSAIC_H100 = [
    _h100("760m", 8, 24, 2, False, 63147),
    _h100("760m", 16, 24, 1, False, 68551),
    _h100("760m", 32, 24, 1, False, 67971),
    _h100("1b", 8, 14, 1, False, 45455),
    _h100("1b", 16, 20, 1, False, 46037),
    _h100("1b", 32, 20, 1, False, 45130),
    _h100("1b", 64, 20, 1, False, 44402),
    _h100("3b", 16, 10, 3, False, 24142),
    _h100("3b", 32, 6, 3, False, 23021),
    _h100("3b", 64, 6, 3, False, 22525),
    _h100("7b", 8, 6, 1, False, 10643),
    _h100("13b", 8, 2, 1, False, 4792),
    _h100("13b", 16, 2, 1, False, 4767),
    _h100("13b", 32, 2, 1, False, 4811),
    _h100("13b", 64, 2, 1, False, 4800),
    _h100("30b", 8, 3, 21, True, 2002),
    _h100("30b", 16, 10, 3, True, 2263),
    _h100("30b", 32, 14, 3, True, 2308),
    _h100("70b", 32, 2, 16, True, 882),
    _h100("70b", 64, 8, 4, True, 1039),
]

MOSAIC_A100 = [
    _a100_80("760m", 8, 24, 2, False, 32434),
    _a100_80("1b", 8, 14, 4, False, 20513),
    _a100_80("3b", 8, 10, 2, False, 10811),
    _a100_80("7b", 8, 6, 2, False, 4641),
    _a100_80("13b", 8, 2, 3, False, 2262),
    _a100_80("30b", 8, 3, 21, True, 916),
    _a100_80("70b", 32, 2, 16, True, 373),
    _a100_80("70b", 64, 8, 4, True, 410),
    _a100_40("760m", 8, 12, 4, False, 30173),
    _a100_40("760m", 16, 12, 1, False, 29607),
    _a100_40("760m", 32, 12, 1, False, 29648),
    _a100_40("760m", 64, 12, 1, False, 29344),
    _a100_40("760m", 128, 12, 1, False, 28940),
    _a100_40("1b", 8, 8, 8, False, 19271),
    _a100_40("1b", 16, 8, 1, False, 19085),
    _a100_40("1b", 32, 10, 1, False, 15555),
    _a100_40("1b", 64, 10, 1, False, 19001),
    _a100_40("1b", 128, 10, 1, False, 18647),
    _a100_40("3b", 8, 5, 8, False, 10065),
    _a100_40("3b", 16, 5, 1, False, 9750),
    _a100_40("3b", 32, 6, 1, False, 9914),
    _a100_40("3b", 64, 6, 1, False, 9736),
    _a100_40("3b", 128, 6, 1, False, 9538),
    _a100_40("7b", 8, 12, 4, True, 3679),
    _a100_40("7b", 16, 16, 1, True, 3645),
    _a100_40("7b", 32, 18, 1, True, 3725),
    _a100_40("7b", 64, 18, 1, True, 3665),
    _a100_40("7b", 128, 18, 1, True, 3623),
    _a100_40("13b", 8, 4, 16, True, 1668),
    _a100_40("13b", 16, 10, 1, True, 1993),
    _a100_40("13b", 32, 14, 1, True, 1998),
    _a100_40("13b", 64, 16, 1, True, 1976),
    _a100_40("13b", 128, 16, 1, True, 1972),
    _a100_40("30b", 32, 4, 1, True, 857),
    _a100_40("30b", 128, 6, 1, True, 865),
    _a100_40("70b", 64, 2, 1, True, 276),
    _a100_40("70b", 128, 4, 1, True, 376),
]


def fsdp_row(run: FsdpRun) -> dict:
    """Predicted vs published tokens/s per GPU for one run, at its layout on its cluster, as its system ran it."""
    from megatron_lite.plan import predict

    p = predict(run.model, run.layout, run.cluster, run.system)
    predicted = p.tokens_per_s / run.gpus
    return {
        "model": f"mpt-{run.model_name}",
        "gpu": run.gpu,
        "gpus": run.gpus,
        "layout": " ".join(run.layout.overrides()),
        "published": run.tokens_per_s_per_gpu,
        "predicted": predicted,
        "error": predicted / run.tokens_per_s_per_gpu - 1,
        "fits": p.fits,
        "step": p.step,
    }


def same_layout_ratios() -> list[tuple[FsdpRun, FsdpRun, float, float]]:
    """(H100 run, A100-80GB run, published H100/A100 tokens/s, predicted ratio) for each model and GPU count both
    tables ran at the same micro-batch and recomputation: how much faster their stack ran on the H100."""
    pairs = []
    for h in MOSAIC_H100:
        for a in MOSAIC_A100:
            if (a.gpu, a.model_name, a.gpus, a.micro_batch, a.recompute) == (
                "a100-80gb",
                h.model_name,
                h.gpus,
                h.micro_batch,
                h.recompute,
            ):
                published = h.tokens_per_s_per_gpu / a.tokens_per_s_per_gpu
                pairs.append((h, a, published, fsdp_row(h)["predicted"] / fsdp_row(a)["predicted"]))
    return pairs
