"""Published H100 runs of fully sharded data parallelism (ZeRO-3-style) the planner is held against.

MosaicML, llm-foundry `scripts/train/benchmarking/README.md`, table "H100 80GB BF16" (github.com/mosaicml/llm-foundry,
read at commit 061f2c7): MPT models of 760M-70B trained with Composer's PyTorch FSDP (FULL_SHARD: parameters,
gradients and optimizer states sharded over every GPU), amp_bf16 (fp32 parameters, bf16 compute and gathers,
fp32 gradient reduction: Composer's DEFAULT mixed precision), flash attention, with and without full activation
checkpointing; throughput as tokens per second per GPU. The rows kept here are its sequence-length-2048 rows on
8-64 GPUs (8 per node, the nodes' network not stated; priced as an HGX H100 node's 8 x 400 Gb/s).

The models, checked against the table's parameter counts to the parameter: GPT-2-style blocks (LayerNorm with
bias, GeLU MLP of 4h, biases everywhere, learned positions, tied embeddings) with a 50,368-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.plan.hardware import GPUS, Cluster
from megatron_lite.plan.timing import System

SOURCE = "MosaicML llm-foundry, scripts/train/benchmarking/README.md, H100 80GB BF16 (061f2c7)"
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
COMPOSER_FSDP = System(name="Composer FSDP 2023", gathers_params=False)


@dataclass(frozen=True)
class FsdpRun:
    model_name: str
    gpus: int
    micro_batch: int
    accumulation: int
    recompute: bool  # full activation checkpointing
    tokens_per_s_per_gpu: float  # published

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
        return Cluster(
            gpu=GPUS["h100-sxm"],
            gpus_per_node=8,
            nodes=self.gpus // 8,
            intra_node_GBps=450,
            inter_node_GBps=400,
            achievable=None,
            reserve_bytes=2 * 2**30,
        )


def _r(name, gpus, micro, accum, ac, tps):
    return FsdpRun(name, gpus, micro, accum, ac, tps)


MOSAIC_H100 = [
    _r("760m", 8, 24, 2, False, 63147),
    _r("760m", 16, 24, 1, False, 68551),
    _r("760m", 32, 24, 1, False, 67971),
    _r("1b", 8, 14, 1, False, 45455),
    _r("1b", 16, 20, 1, False, 46037),
    _r("1b", 32, 20, 1, False, 45130),
    _r("1b", 64, 20, 1, False, 44402),
    _r("3b", 16, 10, 3, False, 24142),
    _r("3b", 32, 6, 3, False, 23021),
    _r("3b", 64, 6, 3, False, 22525),
    _r("7b", 8, 6, 1, False, 10643),
    _r("13b", 8, 2, 1, False, 4792),
    _r("13b", 16, 2, 1, False, 4767),
    _r("13b", 32, 2, 1, False, 4811),
    _r("13b", 64, 2, 1, False, 4800),
    _r("30b", 8, 3, 21, True, 2002),
    _r("30b", 16, 10, 3, True, 2263),
    _r("30b", 32, 14, 3, True, 2308),
    _r("70b", 32, 2, 16, True, 882),
    _r("70b", 64, 8, 4, True, 1039),
]


def fsdp_row(run: FsdpRun) -> dict:
    """Predicted vs published tokens/s per GPU for one run, at its layout on its cluster, as its system ran it."""
    from megatron_lite.plan import predict

    p = predict(run.model, run.layout, run.cluster, COMPOSER_FSDP)
    predicted = p.tokens_per_s / run.gpus
    return {
        "model": f"mpt-{run.model_name}",
        "gpus": run.gpus,
        "layout": " ".join(run.layout.overrides()),
        "published": run.tokens_per_s_per_gpu,
        "predicted": predicted,
        "error": predicted / run.tokens_per_s_per_gpu - 1,
        "fits": p.fits,
        "step": p.step,
    }
