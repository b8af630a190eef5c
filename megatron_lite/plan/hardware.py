"""The devices and the network the planner predicts for: a table of GPUs and a cluster built from them.

Every figure in GPUS is a datasheet figure (NVIDIA's "A100 / H100 / H200 / DGX B200" datasheets) but the
H200's and B200's memory, which the datasheets give in decimal GB of HBM and which is taken as the driver
reports it (nvidia-smi; the "141 GB" H200 holds 140.4 GiB, not 131.3); dense (no 2:4 sparsity) bf16 tensor-core peaks, HBM capacity and bandwidth, NVLink bandwidth per direction per GPU, and
the network a DGX/HGX node of that GPU ships with (one NIC per GPU):

  gpu         memory    bf16 dense    fp8 dense     HBM        NVLink / direction    node network (8 NICs)
  a100-40gb   40 GiB    312 TFLOP/s   -             1555 GB/s  300 GB/s              8 x 200 Gb/s HDR = 200 GB/s
  a100-80gb   80 GiB    312 TFLOP/s   -             2039 GB/s  300 GB/s              8 x 200 Gb/s HDR = 200 GB/s
  h100-sxm    80 GiB    989 TFLOP/s   1979 TFLOP/s  3350 GB/s  450 GB/s              8 x 400 Gb/s NDR = 400 GB/s
  h200        140 GiB   989 TFLOP/s   1979 TFLOP/s  4800 GB/s  450 GB/s              8 x 400 Gb/s NDR = 400 GB/s
  b200        179 GiB   2250 TFLOP/s  4500 TFLOP/s  8000 GB/s  900 GB/s              8 x 400 Gb/s NDR = 400 GB/s

How fast GEMMs and attention run on each class, measured where we could (`Rates`): a GEMM takes its FLOPs at a
fraction of the bf16 peak plus a fixed cost per call (the ramp-up and the last partial wave of tiles, which small
and tp-split GEMMs feel most); attention (flash, forward and backward) likewise at its own fraction and per-call
cost. Fitted on the H100 to two models' kernel times (the torch.profiler tables in bench/results/profiles_h100:
gpt2-124m at 8 x 1024, h = 768, and gpt-1.3b at 4 x 2048, h = 2048; head dim 64): GEMMs 0.823 of the peak +
8.2 us a call, so 0.71 of peak at h = 768 and 0.80 at h = 2048 as measured; cuDNN's flash attention 0.285 + 33 us a
call (0.19 and 0.26 as measured). The H200 (gpt-1.3b's profile, with the H100's per-call costs): 0.822 and 0.292.
(The 8192^3 matmul `make bench-gpu` probes reached 0.74 on either: a sustained single GEMM runs hotter, and
slower, than a model's GEMMs between memory-bound kernels.) The A100s keep 0.65 for both, no per-call cost: the
fit to Megatron-LM's published A100 runs (plan/published.py), the only A100 figures we have. The B200 has none of
its own and takes the H100's. `cluster.achievable` overrides a class's rates: both at that fraction, no per-call
cost.

Collectives are costed as NCCL runs them on such a machine (Thakur et al. 2005 for the formulas; NCCL's docs
for "bus bandwidth"): a group of n ranks moving B bytes takes

  all-reduce       min(ring: 2(n-1)/n * B / bw + 2(n-1) * lat,   tree: 2 B / bw + 2 log2(n) * lat)
  all-gather, reduce-scatter, all-to-all:   (n-1)/n * B / bw + (n-1) * lat     (B: the whole tensor)
  send/recv        B / bw + lat

where bw is the group's bus bandwidth: NVLink within a node; across nodes, each GPU's share of the node's
network times the group's members on one node (every member drives its own NIC, and the other groups of the
same axis, running at the same time, drive the others), capped by NVLink. lat is 5 us within a node and
10 us across nodes (NCCL's measured small-message latencies are of that order). Ranks are laid out tp fastest,
then cp, dp, pp (parallel/context.py), so a group of n ranks with stride `stride` spans n * stride ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GIB = 2**30


@dataclass(frozen=True)
class Rates:
    """How fast a GPU class runs GEMMs and flash attention (module docstring): fractions of its bf16 dense peak
    and fixed seconds per kernel call; `measured` says where the figures come from."""

    gemm: float
    gemm_call_s: float
    attention: float
    attention_call_s: float
    measured: str
    gemm_fp8: float = 0.0  # train.fp8's GEMMs: a fraction of the float8 dense peak (0: the class has no float8)


# Fitted in the module docstring (profiles of commit f4f137b on the H100, e5adc0e on the H200)
# float8 GEMMs (train.fp8): 0.70 of the float8 peak, assumed, not yet measured (`make bench-gpu` records the e4m3
# _scaled_mm rate and the float8 sides' step times for the next fit)
FP8_GEMM_ASSUMED = 0.70
H100_RATES = Rates(0.823, 8.2e-6, 0.285, 33e-6, "H100 kernel times of gpt2-124m and gpt-1.3b", FP8_GEMM_ASSUMED)
H200_RATES = Rates(
    0.822, 8.2e-6, 0.292, 33e-6, "H200 kernel times of gpt-1.3b, the H100's per-call costs", FP8_GEMM_ASSUMED
)
A100_RATES = Rates(0.65, 0.0, 0.65, 0.0, "fitted to Megatron-LM's published A100 runs")
B200_RATES = replace(H100_RATES, measured="none: the H100's")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    hbm_GBps: float  # memory bandwidth, GB/s
    nvlink_GBps: float  # NVLink bandwidth per direction per GPU, GB/s
    node_net_GBps: float  # the node's inter-node network, all NICs together, GB/s
    fp32_flops: float  # plain fp32 (CUDA-core) peak, FLOP/s: what fp32 matmuls get, since the trainer leaves
    # TF32 off (torch's default); metrics/flops.PEAK_TABLE's "fp32" column
    rates: Rates = A100_RATES  # GEMM and attention rates (module docstring)
    fp8_flops: float = 0.0  # dense float8 (e4m3) tensor-core peak, FLOP/s; 0: none (the A100)
    sms: int = 132  # streaming multiprocessors: what an overlapped NCCL kernel takes its share of (plan/timing.py)


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", 40 * GIB, 312e12, 1555, 300, 200, 19.5e12, A100_RATES, sms=108),
        GPU("a100-80gb", 80 * GIB, 312e12, 2039, 300, 200, 19.5e12, A100_RATES, sms=108),
        GPU("h100-sxm", 80 * GIB, 989e12, 3350, 450, 400, 67e12, H100_RATES, 1979e12),
        # "141 GB" sold; the driver reports 143,771 MiB
        GPU("h200", 143_771 * 2**20, 989e12, 4800, 450, 400, 67e12, H200_RATES, 1979e12),
        # "180 GB" sold; the driver reports 183,359 MiB; fp32 80 TFLOP/s: the HGX B200 at 1,000 W in NVIDIA's
        # Blackwell datasheet (not in flops.PEAK_TABLE: probed there)
        GPU("b200", 183_359 * 2**20, 2250e12, 8000, 900, 400, 80e12, B200_RATES, 4500e12, sms=148),
    )
}

# torch.cuda.get_device_name fragments -> table entry, most specific first (for cluster.gpu=auto)
DEVICE_NAMES = (
    (("A100", "40GB"), "a100-40gb"),
    (("A100",), "a100-80gb"),
    (("H200",), "h200"),
    (("GH200",), "h200"),
    (("H100",), "h100-sxm"),
    (("B200",), "b200"),
)

DGX_GPUS = 8  # the node the table's network figures are for: one NIC per GPU (a cluster's default scales them)
INTRA_LATENCY_S = 5e-6
INTER_LATENCY_S = 10e-6


@dataclass(frozen=True)
class Link:
    """The bus bandwidth (bytes/s) and per-hop latency (s) one group's collective sees."""

    bandwidth: float
    latency: float

    def all_reduce(self, nbytes: float, n: int, calls: int = 1) -> float:
        """all-reduce of nbytes in all, in `calls` collectives (each pays the latency of its ring or tree)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        ring = 2 * (n - 1) / n * nbytes / self.bandwidth + calls * 2 * (n - 1) * self.latency
        tree = 2 * nbytes / self.bandwidth + calls * 2 * math.log2(n) * self.latency
        return min(ring, tree)

    def gather(self, nbytes: float, n: int, calls: int = 1) -> float:
        """all-gather, reduce-scatter or all-to-all of nbytes in all (the gathered size), in `calls` collectives
        (each pays the ring's latency)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1) / n * nbytes / self.bandwidth + calls * (n - 1) * self.latency

    def p2p(self, nbytes: float) -> float:
        return nbytes / self.bandwidth + self.latency if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra_node_GBps: float
    inter_node_GBps: float
    achievable: float | None  # GEMMs and attention at this fraction of the peak; None: the GPU's measured rates
    reserve_bytes: int  # per GPU, not available to tensors: CUDA context, NCCL buffers, allocator slack

    @property
    def rates(self) -> Rates:
        """The GEMM and attention rates to price with: the GPU class's, or cluster.achievable for both."""
        if self.achievable is None:
            return self.gpu.rates
        return Rates(self.achievable, 0.0, self.achievable, 0.0, "cluster.achievable", self.achievable)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_bytes(self) -> int:
        return self.gpu.memory_bytes - self.reserve_bytes

    def link(self, size: int, stride: int) -> Link:
        """The link of a group of `size` ranks `stride` apart in the rank order."""
        intra = self.intra_node_GBps * 1e9
        if self.gpus_per_node % (size * stride) == 0:  # every such group inside a node (else some straddle two)
            return Link(intra, INTRA_LATENCY_S)
        per_node = max(1, self.gpus_per_node // stride) if stride < self.gpus_per_node else 1
        per_gpu = self.inter_node_GBps * 1e9 / self.gpus_per_node
        return Link(min(intra, per_gpu * per_node), INTER_LATENCY_S)


def gpu_named(name: str) -> GPU:
    """A GPUS entry; `auto` is this machine's CUDA device when the table knows it, else h100-sxm."""
    if name == "auto":
        name = local_gpu() or "h100-sxm"
    return GPUS[name]


def local_gpu() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.get_device_name()
    for fragments, name in DEVICE_NAMES:
        if all(f in device for f in fragments):
            return name
    return None
