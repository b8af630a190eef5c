"""Predicted step time of a layout on a cluster: compute, memory-bound work, communication, bubble, optimizer.

Assumptions, each a choice a reader can disagree with:
  - GEMMs run at the GPU class's measured fraction of the bf16 dense peak plus a fixed cost per call, flash
    attention at its own fraction plus its own per-call cost (plan/hardware.Rates: on an H100 0.823 + 8 us and
    0.285 + 33 us), or both at `cluster.achievable` with no per-call cost when that is set (fp32: fractions of
    the plain fp32 CUDA-core peak, since the trainer leaves TF32 off, torch's default). A layer's forward makes 4
    GEMM calls (QKV, the output projection, the MLP's two: SwiGLU's gate and up are one) and its backward 8 (input
    and weight gradients); the head 1 and 2; attention one call each way. FLOPs are those of metrics/flops.py
    (causal attention at half, as flash attention skips masked blocks); recomputation adds what it reruns
    (metrics/flops.recompute_flops_per_token's rule).
  - Element-wise work (norms, residual adds with dropout, GeLU/SwiGLU, RoPE, the cross entropy over the
    logits) is bound by HBM bandwidth: each pass reads and writes its tensors once; a backward pass moves twice
    the forward's bytes. Without SP the residual-stream work is repeated on every TP rank; with SP it is split.
    This trainer's passes reach 0.60 of the datasheet's HBM bandwidth (System.elementwise_bw, measured).
  - Tensor-parallel collectives (parallel/mappings.py) are not overlapped with compute; context-parallel ring
    hops are, each behind its block's share of the attention core; Ulysses' all-to-alls are not.
  - Pipeline messages (one per forward and per backward of a chunk) are not overlapped (the executor waits).
    The bubble is the schedule simulator's, applied to the mean rank; the slowest rank (embedding or head) sets
    the rest.
  - Data parallelism: ZeRO-0 and ZeRO-1 all-reduce fp32 gradients once after the last micro-batch (exposed), in
    DeepSpeed's buckets, each a collective paying its latency (5e7 elements for ZeRO's optimizers, 5e8 for ZeRO-0's
    and BF16_Optimizer's fallback: StepModel._reduce_calls); ZeRO-2 all-reduces every micro-batch's gradients during
    its backward, ZeRO-3 reduce-scatters them and gathers bf16 parameters before each forward and backward:
    overlapped with that micro-batch's compute (DeepSpeed's overlap_comm), exposed only where the collective is
    longer. Overlap is not free: while NCCL's kernel runs, its 24 thread blocks hold 24 of the GPU's SMs (an
    all-gather beside a GEMM on an H100, NVIDIA developer forums, "Compute-Communication Overlap Causes Severe GEMM
    Performance Degradation because of Tail Effect", 2025), and the backward runs on the rest: 24/132 of the
    overlapped time is added on an H100, 24/108 on an A100. (That post's GEMM, one wave of 132 blocks, went from 80%
    to 47% of peak, the worst case; a GEMM of many waves loses the SMs' share.) ZeRO 1-3 all-gather the updated bf16
    parameters after the step (the volumes tools/bench_comm.py measured). ZeRO-3 as DeepSpeed 0.19 runs it at its
    defaults: one all-gather per fetched module (a layer's 4 linears, the embedding and the head) each forward, and
    in backward again only for what its 1e9-element live window (stage3_max_live_parameters, max_reuse_distance)
    released, the parameters past 1e9 (measured on CPU: one gather a step below it, as plan/states.py prices the
    memory); one reduce-scatter per 5e7-element reduce bucket; each collective pays the ring's latency. PyTorch FSDP
    wrapping each block (System.fsdp_units: the published FSDP runs) gathers a block for its forward and again for
    its backward and reduce-scatters its gradients, one collective each.
  - The optimizer step is HBM-bound: AdamW reads gradient, master weight and two moments and writes three of
    them plus the bf16 copy where there is one (28 or 30 bytes per parameter of the local partition), at 0.78 of the
    bandwidth for this trainer; ZeRO-0 adds its gradient-norm pass (4 bytes), and in bf16 autocast's weight and
    gradient copies (StepTime.casts_s). bf16 ZeRO-1 runs DeepSpeed's BF16_Optimizer, which keeps whole fp32
    gradients: every micro-batch adds each bf16 gradient into them through an fp32 copy and zeroes it (20 bytes a
    parameter), and each step measures their norm (4), clips them (8), zeroes them and the bf16 ones (6), and copies
    the updated fp32 partition into the bf16 one (4 more than the 2 counted above). With the optimizer offloaded, the
    partition's gradients and parameters cross PCIe (25 GB/s each way) and DeepSpeed's CPU Adam updates about
    1e9 parameters/s per GPU's share of the host (ZeRO-Offload, Ren et al. 2021, reports that order).
  - train.fp8: the blocks' GEMMs at the GPU class's float8 rate (Rates.gemm_fp8 of the float8 peak; assumed
    0.70 until a GPU measures it), the head's in bf16; torchao's dynamic casts as HBM passes (_fp8_casts).
    Memory is bf16's: dynamic scaling keeps no amax history or scale buffers, and its matmul saves the same
    high-precision inputs for backward (parallel/fp8.py); only one projection's float8 copies exist at a time.
Not modelled: kernel launch overheads, data loading, stragglers, network contention between axes, the tied
embedding's gradient all-reduce between the first and last stage (one (V/tp) x h tensor per step), the HBM bandwidth
an overlapped collective takes beside its SMs, and the SMs of context parallelism's overlapped ring hops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.layout import Layout
from megatron_lite.metrics.flops import layer_flops_per_token
from megatron_lite.parallel.fp8 import HIGH_PRECISION_WEIGHT_GRAD
from megatron_lite.pipeline.partition import stage_layers, virtual_stage
from megatron_lite.pipeline.schedules import build_schedule, v_shaped
from megatron_lite.pipeline.simulate import expected_bubble, simulate
from megatron_lite.plan.activations import head_vocab
from megatron_lite.plan.hardware import Cluster
from megatron_lite.plan.states import MAX_LIVE

PCIE_BPS = 25e9
REDUCE_BUCKET = 50_000_000  # elements: ZeRO's reduce_bucket_size (engine/ds_config.py)
ALLREDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's buffered_allreduce_fallback (ZeRO-0, BF16_Optimizer's ZeRO-1)
CPU_ADAM_PARAMS_PER_S = 1e9
NCCL_BLOCKS = 24  # thread blocks an overlapped NCCL collective holds, each on an SM (module docstring)
SIMULATE_UP_TO = 512  # pp * vpp * m: schedules the simulator runs; larger ones take its closed form


@dataclass(frozen=True)
class System:
    """How the trainer being priced runs its kernels and collectives. OURS is this trainer; the published
    Megatron-LM runs of 2021-2022 (plan/published.py) differ where noted there."""

    name: str = "megatron_lite"
    flash_attention: bool = True  # the core keeps its scores on chip and skips masked blocks
    reduce_bytes: int = 4  # DP gradient reduction dtype (DeepSpeed: communication_data_type=fp32)
    dp_overlap_stages: tuple[int, ...] = (2, 3)  # ZeRO stages whose gradient reduction overlaps backward
    regather_sp: bool = True  # SP column-parallel layers all-gather their input again in backward
    pp_scatter_gather: bool = False  # pipeline messages split over TP ranks, gathered over NVLink after
    fsdp_units: bool = False  # ZeRO-3 as PyTorch FSDP FULL_SHARD wrapping each block: per block, a gather in forward,
    # another in backward and a reduce-scatter (DeepSpeed's: per module, a live window, 5e7-element buckets)
    gathers_params: bool = True  # ZeRO 1-3 all-gather the updated parameters after the step
    reduce_buckets: bool = True  # DP gradients reduced bucket by bucket, each a collective paying its latency
    # (DeepSpeed's sizes: reduce_bucket_size for ZeRO's optimizers, 5e8 elements for ZeRO-0 and BF16_Optimizer);
    # False: one collective over a contiguous buffer (Megatron-LM's local DDP of 2021-22)
    # Shares of the HBM bandwidth the memory-bound work reaches, and the passes only this trainer makes; measured on
    # one H100 (bench/results/gpu_h100_80gb_hbm3.md "Where gpt-1.3b's step goes", ours-auto at 4 x 2048); the
    # published systems keep 1.0 and none, as their throughput was fitted with (plan/published.py)
    elementwise_bw: float = 1.0  # norms, activations, residuals, RoPE, the loss
    optimizer_bw: float = 1.0  # AdamW's pass over its states, the gradient norm
    cast_bw: float = 1.0  # autocast's copies of each weight and gradient (many small tensors)
    autocast_passes: bool = False  # ZeRO-0 bf16's weight and gradient casts, and its own gradient-norm pass
    bf16_optimizer_passes: bool = False  # bf16 ZeRO-1's DeepSpeed BF16_Optimizer: whole fp32 gradients (module doc)


# Measured at gpt-1.3b on the H100: the element-wise work the planner counts, 18.2 ms at the datasheet's 3.35 TB/s,
# took 30.5 ms (0.60); fused AdamW's 28 bytes a parameter ran at 2.6 TB/s (0.78), the same as the norm's pass (5.2 GB
# in 2.0 ms); the 536 casts a step moved 15.8 GB in 13.5 ms (0.36).
OURS = System(elementwise_bw=0.60, optimizer_bw=0.78, cast_bw=0.36, autocast_passes=True, bf16_optimizer_passes=True)


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # GEMMs and attention on the slowest pipeline rank, all micro-batches
    memory_s: float  # element-wise work there
    tp_s: float  # tensor-parallel collectives there
    cp_s: float  # exposed context-parallel communication there
    pp_s: float  # pipeline messages there
    bubble_s: float  # idle pipeline time
    dp_s: float  # exposed data-parallel / ZeRO communication, and the SMs its overlapped part takes from compute
    optimizer_s: float
    bubble: float  # the schedule's bubble as a share of ideal time
    casts_s: float = 0.0  # ZeRO-0 bf16: autocast's weight copies (once a step) and gradient copies (per micro-batch)

    @property
    def total_s(self) -> float:
        return (
            self.casts_s
            + self.compute_s
            + self.memory_s
            + self.tp_s
            + self.cp_s
            + self.pp_s
            + self.bubble_s
            + self.dp_s
            + self.optimizer_s
        )


@dataclass(frozen=True)
class _Work:
    """One chunk's forward or backward for one micro-batch on one rank, in seconds by kind."""

    compute: float = 0.0
    memory: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    pp: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.tp + self.cp + self.pp

    def __add__(self, other: _Work) -> _Work:
        return _Work(
            self.compute + other.compute,
            self.memory + other.memory,
            self.tp + other.tp,
            self.cp + other.cp,
            self.pp + other.pp,
        )

    def scale(self, k: float) -> _Work:
        return _Work(self.compute * k, self.memory * k, self.tp * k, self.cp * k, self.pp * k)


@functools.lru_cache(maxsize=4096)
def schedule_bubble(name: str, pp: int, vpp: int, m: int) -> float:
    """(makespan - ideal) / ideal of the schedule: the simulator's figure (the same for any forward/backward
    cost ratio, tests/unit/test_pipeline_schedules.py) for schedules it runs quickly, its closed form beyond
    (which the same tests hold it to). Zero-bubble schedules at F = B = W (forward 1, backward 2, half of it W),
    the paper's setting and a dense transformer's rough proportions."""
    if pp == 1:
        return 0.0
    if pp * vpp * m > SIMULATE_UP_TO:
        return expected_bubble(name, pp, vpp, m)
    return simulate(build_schedule(name, pp, vpp, m), pp, vpp, m, name=name).bubble


class StepModel:
    """Prices one layout of one model on one cluster."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout,
        cluster: Cluster,
        system: System = OURS,
        dropout: bool | None = None,
    ):
        self.cfg, self.lay, self.cluster, self.system = cfg, layout, cluster, system
        bf16 = layout.precision == "bf16"
        self.act = 2 if bf16 else 4
        peak = cluster.gpu.bf16_flops if bf16 else cluster.gpu.fp32_flops
        rates = cluster.rates
        self.gemm_per_s, self.gemm_call_s = peak * rates.gemm, rates.gemm_call_s
        # train.fp8: the blocks' GEMMs at the class's float8 rate (the head's stay bf16; rowwise_with_gw_hp's
        # weight-gradient GEMMs too), plus torchao's casts
        self.layer_gemm_per_s = self.layer_backward_per_s = self.gemm_per_s
        if layout.fp8 != "none":
            if cluster.gpu.fp8_flops == 0:
                raise ConfigError(
                    f"train.fp8={layout.fp8} cannot run on cluster.gpu={cluster.gpu.name}, which has no float8 "
                    "tensor cores; use train.fp8=none, or an H100, H200 or B200"
                )
            self.layer_gemm_per_s = cluster.gpu.fp8_flops * rates.gemm_fp8
            # the backward's two GEMMs of equal FLOPs: input gradients in float8, weight gradients in one or other
            fp8_s, hp_s = 1 / self.layer_gemm_per_s, 1 / self.gemm_per_s
            weight_s = hp_s if layout.fp8 in HIGH_PRECISION_WEIGHT_GRAD else fp8_s
            self.layer_backward_per_s = 2 / (fp8_s + weight_s)
        self.attention_per_s, self.attention_call_s = peak * rates.attention, rates.attention_call_s
        # one layer's forward FLOPs per token: its GEMMs, and its attention core (halved when causal and fused)
        self.dense_flops, self.core_flops = layer_flops_per_token(cfg, cfg.seq_len, causal=system.flash_attention)
        self.hbm = cluster.gpu.hbm_GBps * 1e9 * system.elementwise_bw  # what the element-wise passes reach
        self.hbm_optimizer = cluster.gpu.hbm_GBps * 1e9 * system.optimizer_bw
        self.hbm_casts = cluster.gpu.hbm_GBps * 1e9 * system.cast_bw
        lay = layout
        self.tp_link = cluster.link(lay.tp, 1)
        self.cp_link = cluster.link(lay.cp, lay.tp)
        self.dp_link = cluster.link(lay.zero_partitions, lay.tp)  # one ZeRO group (zero.shard_size's, or all dp x cp)
        # hybrid sharding's replicas: the ranks at one place of every ZeRO group, a group's width apart
        self.replica_link = cluster.link(lay.replicas, lay.zero_partitions * lay.tp)
        self.hpz_link = cluster.link(lay.hpz, lay.tp)  # hpZ's secondary-shard groups: consecutive ZeRO ranks
        self.pp_link = cluster.link(lay.pp, lay.tp * lay.cp * lay.dp)
        self.s = cfg.seq_len // lay.cp  # tokens of a sequence on this rank
        self.T = lay.micro_batch_size * self.s  # tokens of a micro-batch on this rank
        self.dropout = cfg.dropout > 0 if dropout is None else dropout

    # --- one layer ---

    def _gemms(self, flops: float, calls: int, per_s: float | None = None) -> float:
        return flops / (per_s or self.gemm_per_s) + calls * self.gemm_call_s

    def _fp8_casts(self) -> tuple[float, float]:
        """Elements torchao's float8 casts of one layer's four projections move, forward and backward, in bytes
        (module docstring): each cast reads its high-precision tensor twice (the amax, then the cast) and writes
        one byte an element; forward casts every input and weight, backward the output gradients twice (one per
        GEMM), the inputs again (for the weight gradient) and the weights again (for the input gradient)."""
        if self.lay.fp8 == "none":
            return 0.0, 0.0
        cfg, lay, T = self.cfg, self.lay, self.T
        h, f = cfg.d_model, cfg.ffn // lay.tp
        q, kv = cfg.n_heads // lay.tp * cfg.head_dim, cfg.kv_heads // lay.tp * cfg.head_dim
        up = f * (2 if cfg.activation == "swiglu" else 1)
        inputs = T * (h + q + h + f)  # qkv, proj, fc_in, fc_out
        grads = T * ((q + 2 * kv) + h + up + h)
        weights = h * (q + 2 * kv) + q * h + h * up + f * h
        w_bytes = 4 if lay.zero_stage == 0 else self.act  # ZeRO-0 keeps fp32 weights, ZeRO 1-3 bf16 ones
        per_act, per_weight = 2 * self.act + 1, 2 * w_bytes + 1
        backward = 2 * grads + inputs  # rowwise_with_gw_hp casts neither for the weight gradient
        if lay.fp8 in HIGH_PRECISION_WEIGHT_GRAD:
            backward = grads
        return (inputs * per_act + weights * per_weight, backward * per_act + weights * per_weight)

    def _attention(self, flops: float) -> float:
        """One attention call (a forward, or a backward of twice the forward's FLOPs)."""
        return flops / self.attention_per_s + self.attention_call_s

    def _core_forward_s(self) -> float:
        """This rank's attention core of one layer for one micro-batch, forward."""
        return self._attention(self.T * self.core_flops / self.lay.tp)

    def _layer_forward(self) -> _Work:
        cfg, lay, act, T = self.cfg, self.lay, self.act, self.T
        tp, h = lay.tp, cfg.d_model
        core_s = self._core_forward_s()
        compute = self._gemms(T * self.dense_flops / tp, 4, self.layer_gemm_per_s) + core_s
        a, k, f = cfg.n_heads // tp, cfg.kv_heads // tp, cfg.ffn // tp
        residual_tokens = T / tp if lay.sp else T
        elems = residual_tokens * 10 * h  # 2 norms (read, write), 2 residual adds with dropout (read 2, write 1)
        elems += T * f * (3 if cfg.activation == "swiglu" else 2)
        if cfg.position == "rope":
            elems += T * 2 * (a + k) * cfg.head_dim
        if not self.system.flash_attention:  # scores written, softmax and dropout read and write them
            elems += T * a * cfg.seq_len * 5
        memory = (elems * act + self._fp8_casts()[0]) / self.hbm
        tensor = T * h * act  # (b, s/cp, h)
        if lay.sp:
            tp_s = 2 * self.tp_link.gather(tensor, tp) * 2  # 2 all-gathers + 2 reduce-scatters
        else:
            tp_s = 2 * self.tp_link.all_reduce(tensor, tp)
        return _Work(compute, memory, tp_s, self._cp_forward(core_s))

    def _cp_forward(self, core_s: float) -> float:
        cfg, lay = self.cfg, self.lay
        if lay.cp == 1:
            return 0.0
        k, a, d = cfg.kv_heads // lay.tp, cfg.n_heads // lay.tp, cfg.head_dim
        if lay.cp_mode == "ulysses":  # q, k, v in and the output back, each an all-to-all of this rank's shard
            return self.cp_link.gather(self.T * (2 * a + 2 * k) * d * self.act, lay.cp)
        hop = self.cp_link.p2p(2 * self.T * k * d * self.act)  # K and V of both local chunks
        return (lay.cp - 1) * max(0.0, hop - core_s / lay.cp)

    def _layer_backward(self, forward: _Work, recomputed: bool) -> _Work:
        """Twice the forward's FLOPs (in 8 GEMM calls and one attention call) and memory traffic; TP: the forward's
        collectives once more, plus the SP re-gathers; CP: the K/V hops again plus fp32 dK/dV hops. A recomputed
        layer repeats its forward."""
        lay, cfg = self.lay, self.cfg
        compute = self._gemms(2 * self.T * self.dense_flops / lay.tp, 8, self.layer_backward_per_s)
        compute += self._attention(2 * self.T * self.core_flops / lay.tp)
        tensor = self.T * cfg.d_model * self.act
        if lay.sp:
            extra = 2 * self.tp_link.gather(tensor, lay.tp) if self.system.regather_sp else 0.0
            tp_s = forward.tp + extra
        else:
            tp_s = forward.tp
        cp_s = 0.0
        if lay.cp > 1:
            if lay.cp_mode == "ulysses":
                cp_s = forward.cp
            else:
                k, d = cfg.kv_heads // lay.tp, cfg.head_dim
                hop = self.cp_link.p2p(2 * self.T * k * d * (self.act + 4))
                cp_s = (lay.cp - 1) * max(0.0, hop - 2 * self._core_forward_s() / lay.cp)
        fwd_casts, bwd_casts = self._fp8_casts()
        work = _Work(compute, 2 * (forward.memory - fwd_casts / self.hbm) + bwd_casts / self.hbm, tp_s, cp_s)
        if recomputed:  # torch's early stop skips fc_out's GEMM; a rounding next to the layer's cost
            work = work + forward
        elif lay.recompute == "selective":
            work = work + _Work(compute=self._core_forward_s())
        return work

    # --- chunks and ranks ---

    def _head(self) -> tuple[_Work, _Work]:
        """LM head GEMM and the cross entropy's passes over the (b, s, V/tp) logits (fp32)."""
        cfg, lay, T = self.cfg, self.lay, self.T
        V = head_vocab(cfg, lay.tp)
        flops = 2 * T * cfg.d_model * V
        logits = T * V * (self.act + 4 * 3) / self.hbm  # logits out; shifted, exp, softmax in fp32
        tensor = T * cfg.d_model * self.act
        comm = self.tp_link.gather(tensor, lay.tp) if lay.sp else self.tp_link.all_reduce(tensor, lay.tp)
        ce = 3 * self.tp_link.all_reduce(T * 4, lay.tp)
        fwd = _Work(self._gemms(flops, 1), logits, comm + ce)
        return fwd, _Work(self._gemms(2 * flops, 2), 2 * logits, comm)

    def _embedding(self) -> _Work:
        tensor = self.T * self.cfg.d_model * self.act
        return _Work(memory=tensor / self.hbm, tp=self.tp_link.all_reduce(tensor, self.lay.tp))

    def _chunk_work(self) -> list[list[tuple[_Work, _Work]]]:
        lay, cfg = self.lay, self.cfg
        fwd = self._layer_forward()
        bwd_plain, bwd_recomputed = self._layer_backward(fwd, False), self._layer_backward(fwd, True)
        recomputed = set(range(0, cfg.n_layers, lay.recompute_every)) if lay.recompute == "full" else set()
        stages = stage_layers(cfg.n_layers, lay.pp, lay.vpp, list(lay.pp_layers) if lay.pp_layers else None)
        last = lay.pp * lay.vpp - 1
        message = (
            self.pp_link.p2p(
                self.T * cfg.d_model * self.act / (lay.tp if lay.sp or self.system.pp_scatter_gather else 1)
            )
            if lay.pp > 1
            else 0.0
        )
        ranks = []
        for r in range(lay.pp):
            chunks = []
            for c in range(lay.vpp):
                v = virtual_stage(r, c, lay.pp, v_shaped(lay.schedule))
                f, b = _Work(), _Work()
                for layer in stages[v]:
                    f = f + fwd
                    b = b + (bwd_recomputed if layer in recomputed else bwd_plain)
                if v == 0:
                    f, b = f + self._embedding(), b + self._embedding()
                if v == last:
                    hf, hb = self._head()
                    f, b = f + hf, b + hb
                f = f + _Work(pp=message if v < last else 0.0)
                b = b + _Work(pp=message if v > 0 else 0.0)
                chunks.append((f, b))
            ranks.append(chunks)
        return ranks

    # --- data parallelism and the optimizer ---

    @property
    def _bf16_optimizer(self) -> bool:
        """Whether DeepSpeed runs the layout's optimizer as BF16_Optimizer (bf16 ZeRO-1), which keeps whole fp32
        gradients and reduces them through the engine's fallback (module docstring)."""
        return (self.lay.zero_stage, self.lay.precision) == (1, "bf16")

    def _reduce_calls(self, params: int) -> int:
        """How many all-reduce collectives the DP gradient reduction of `params` parameters makes: DeepSpeed's ZeRO
        optimizers reduce reduce_bucket_size elements at a time; its engine's fallback, which ZeRO-0 (Engine.step)
        and bf16 ZeRO-1's BF16_Optimizer go through, 5e8 (DeepSpeed 0.19, engine.allreduce_gradients)."""
        if not self.system.reduce_buckets:
            return 1
        fallback = self.lay.zero_stage == 0 or self._bf16_optimizer
        return -(-params // (ALLREDUCE_BUCKET if fallback else REDUCE_BUCKET))

    def _dp_and_optimizer(self, params_per_rank: int, backward_s: float) -> tuple[float, float]:
        """(exposed DP/ZeRO communication, optimizer step) seconds per step for `params_per_rank` parameters."""
        lay, n, link = self.lay, self.lay.zero_partitions, self.dp_link
        m = lay.accumulation
        P = params_per_rank
        reduce = link.all_reduce(P * self.system.reduce_bytes, n, self._reduce_calls(P))
        # ZeRO 1-2 all-gather the updated partitions after the step; ZeRO-3 gathers in forward and backward instead
        gather = link.gather(P * self.act, n) if lay.zero_stage in (1, 2) and self.system.gathers_params else 0.0
        if lay.zero_stage in self.system.dp_overlap_stages:
            # DeepSpeed 0.19: ZeRO-2 all-reduces each bucket, ZeRO-3 reduce-scatters (half the bytes) and gathers
            # the parameters for forward, and for backward what its live window released (tools/bench_comm.py
            # counts both); with hpZ the backward's gather is within its group, from the secondary shards
            if self.system.fsdp_units:  # the blocks and the root: each gathered both ways and reduced once
                modules = back_calls = buckets = self.cfg.n_layers // lay.pp + 1
                regather = P
            else:
                modules = 4 * self.cfg.n_layers // lay.pp + 2  # fetched modules of a pipeline rank: one gather each
                regather = max(0, P - MAX_LIVE)
                back_calls = -(-modules * regather // P) if regather else 0
                buckets = -(-P // REDUCE_BUCKET)
            gather_link, gather_n = (self.hpz_link, lay.hpz) if lay.hpz > 1 else (link, n)
            backward_gather = gather_link.gather(regather * self.act, gather_n, back_calls)
            scatter = link.gather(P * self.system.reduce_bytes, n, buckets)
            forward_gather = link.gather(P * self.act, n, modules)
            per_micro = reduce if lay.zero_stage == 2 else scatter + forward_gather + backward_gather
            # while NCCL's blocks hold their SMs, the backward's kernels run on the rest (module docstring)
            slowed = NCCL_BLOCKS / self.cluster.gpu.sms * min(per_micro, backward_s)
            exposed = m * (max(0.0, per_micro - backward_s) + slowed)
        else:
            exposed = reduce
        partition = P / n if lay.zero_stage >= 1 else P
        if lay.replicas > 1:  # hybrid sharding: the replicas average each rank's fp32 partition once, before the step
            averaged = P if self._bf16_optimizer else partition  # BF16_Optimizer: whole
            exposed += self.replica_link.all_reduce(averaged * 4, lay.replicas)
        if lay.offload_optimizer != "none":
            optimizer = partition / CPU_ADAM_PARAMS_PER_S + partition * (4 + self.act) / PCIE_BPS
        else:  # gradient, master weight, two moments read; three written; and the bf16 copy where there is one
            optimizer = partition * (28 + (2 if lay.bf16_states else 0)) / self.hbm_optimizer
        if lay.zero_stage == 0 and self.system.autocast_passes:  # Engine._reduced_grad_norm reads every gradient
            optimizer += P * 4 / self.hbm_optimizer
        if self._bf16_optimizer and self.system.bf16_optimizer_passes:
            # DeepSpeed's BF16_Optimizer on its whole fp32 gradients: accumulate (per micro-batch), norm, clip, zero
            optimizer += (P * (20 * m + 4 + 8 + 6) + partition * 4) / self.hbm_optimizer
        return exposed + gather, optimizer

    def step(self, params_per_rank: list[int]) -> StepTime:
        """The step time; params_per_rank: parameters held by each pipeline rank (plan/params.py)."""
        lay = self.lay
        m = lay.accumulation
        work = self._chunk_work()
        per_rank = []
        for chunks in work:
            f = _Work()
            for cf, cb in chunks:
                f = f + cf + cb
            per_rank.append(f.scale(m))
        slowest = max(range(lay.pp), key=lambda r: per_rank[r].total)
        mean = sum(w.total for w in per_rank) / lay.pp
        bubble = schedule_bubble(lay.schedule, lay.pp, lay.vpp, m)
        backward_s = max(sum(cb.total for _, cb in chunks) for chunks in work)
        priced = [self._dp_and_optimizer(p, backward_s) for p in params_per_rank]
        dp_s, opt_s = max(d for d, _ in priced), max(o for _, o in priced)
        w = per_rank[slowest]
        casts_s = 0.0
        if self.system.autocast_passes and lay.zero_stage == 0 and lay.precision == "bf16":
            # each fp32 weight to bf16 once a step (parallel/weight_grad.one_copy_per_step), each bf16 weight
            # gradient back to fp32 in every micro-batch's backward: 6 bytes a parameter each
            casts_s = max(params_per_rank) * 6 * (1 + m) / self.hbm_casts
        return StepTime(w.compute, w.memory, w.tp, w.cp, w.pp, bubble * mean, dp_s, opt_s, bubble, casts_s)
