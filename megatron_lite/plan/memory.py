"""Predicted peak memory of every rank of a layout: states (plan/states.py) plus activations held at once
(plan/activations.py, times what the schedule keeps in flight, plan/schedule_memory.py), or the optimizer step.

A rank's peak is the larger of two moments:
  forward/backward  persistent states + gradients allocated so far in the step + the activations of every
                    micro-batch its chunks hold + the transient of the backward running then (the cross entropy's
                    fp32 buffers on the last stage, a layer's gradient buffers or a recomputed layer elsewhere,
                    ZeRO-2/3's reduce buffers)
  optimizer step    persistent states + the step's gradients + the step's temporaries
Ranks that differ only in their tp, cp or dp coordinate hold the same bytes (DeepSpeed pads every partition to
the same size), so one rank per pipeline stage is priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.layout import Layout
from megatron_lite.pipeline.partition import rank_chunks
from megatron_lite.pipeline.schedules import v_shaped
from megatron_lite.plan import activations as A
from megatron_lite.plan.params import chunk_param_count, padded_vocab, rank_params
from megatron_lite.plan.schedule_memory import most_held, peak_activations
from megatron_lite.plan.states import zero_states


@dataclass(frozen=True)
class RankMemory:
    pp_rank: int
    params: int  # DeepSpeed's parameter buffers
    grads: int  # gradient buffers kept between steps
    optimizer: int  # master weights, moments, step counters
    buffers: int  # reduce bucket, tied-embedding accumulator, RoPE tables, scalars
    activations: int  # at the peak: activations held plus the running backward's transient
    step_grads: int  # at the peak: gradient buffers allocated within the step
    step: int  # at the peak: the optimizer step's temporaries (0 unless the peak is the step)
    host: int  # offloaded states in CPU memory (not counted in the peak)
    host_optimizer: int  # of host: master weights and moments
    host_params: int  # of host: ZeRO-3 parameter partitions
    held: int  # the most activation bytes kept for backward at once (what autograd saves)
    phase: str  # "backward", "forward" or "optimizer step": where the peak is

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def peak(self) -> int:
        return self.states + self.activations + self.step_grads + self.step


def micro_shape(cfg: ModelConfig, lay: Layout, cuda: bool) -> A.MicroShape:
    bf16 = lay.precision == "bf16"
    autocast = bf16 and lay.zero_stage == 0  # ZeRO-0 bf16 trains fp32 parameters under autocast (engine.py)
    act = 2 if bf16 else 4
    res = 4 if autocast or not bf16 else 2
    return A.MicroShape(
        b=lay.micro_batch_size,
        s=cfg.seq_len // lay.cp,
        tp=lay.tp,
        sp=lay.sp,
        cp=lay.cp,
        cp_mode=lay.cp_mode,
        flash=cuda or cfg.dropout == 0,
        act=act,
        res=res,
        autocast=autocast,
        dropout=cfg.dropout > 0,
        stats=4 if cuda else res,
        f32_wgrad=autocast and not cuda,
        triton_ce=cuda,  # kernels.backend=auto's choice on CUDA (kernels/__init__.py TRITON_FASTER_ON_CUDA)
    )


def rank_memory(cfg: ModelConfig, lay: Layout, pp_rank: int, cuda: bool = True) -> RankMemory:
    """Predicted bytes of pipeline rank `pp_rank` (every tp/cp/dp rank of it alike)."""
    pp_layers = list(lay.pp_layers) if lay.pp_layers else None
    params = rank_params(cfg, lay.tp, lay.pp, lay.vpp, pp_rank, pp_layers, v_shaped(lay.schedule))
    bf16 = lay.precision == "bf16"
    st = zero_states(
        params,
        lay.zero_partitions,
        lay.zero_stage,
        bf16,
        lay.offload_optimizer != "none",
        lay.offload_param != "none",
        cuda,
        lay.hpz,
    )
    chunks = rank_chunks(pp_rank, lay.pp, lay.vpp, cfg.n_layers, pp_layers, v_shaped(lay.schedule))
    first, last = any(c.has_embedding for c in chunks), any(c.has_head for c in chunks)
    x = micro_shape(cfg, lay, cuda)

    buffers = st.buffers + (4 if last else 0)  # the executor keeps the step's last loss (engine.last_stats)
    if cfg.position == "rope":
        buffers += 2 * cfg.seq_len * cfg.head_dim * 4  # cos/sin tables
    wte = padded_vocab(cfg, lay.tp) // lay.tp * cfg.d_model
    tied_copy = lay.pp > 1 and cfg.tie_embeddings and (first or last)
    if tied_copy:
        buffers += 4 * wte  # model/tied.py's fp32 gradient accumulator

    recomputed = set(range(0, cfg.n_layers, lay.recompute_every)) if lay.recompute == "full" else set()
    kept_mode = "selective" if lay.recompute == "selective" else "none"
    full_layer = A.layer_bytes(cfg, x, kept_mode)
    input_only = A.layer_bytes(cfg, x, "full")
    per_micro, loss_t, grad_t, grads = [], [], [], []
    copies = 0  # under autocast: one bf16 copy of each weight the rank multiplies, for the whole schedule
    total_params = params.numel or 1
    for spec in chunks:
        rerun = sum(1 for i in spec.layers if i in recomputed)
        held = rerun * input_only + (len(spec.layers) - rerun) * full_layer
        layer_t = A.layer_backward_transient(cfg, x) if spec.layers else 0
        # A rerun rebuilds one layer's activations during its backward. The backward runs the chunk's layers last to
        # first, each freeing what it held, so a rerun layer rebuilds them once the layers above it are gone: with
        # train.recompute_every=2 and the top layer kept whole, the layer below rebuilds into the room it freed.
        above, rebuilt = 0, 0
        for i in reversed(spec.layers):
            if i in recomputed:
                rebuilt = max(rebuilt, full_layer - above)
            above += input_only if i in recomputed else full_layer
        layer_t += rebuilt
        released = 0
        if spec.has_embedding:
            held += A.embedding_saved(cfg, x)
        if spec.has_head:  # the loss's backward comes first; parameter gradients once its buffers are gone
            released = A.head_saved(cfg, x)
            held += released
            loss_t.append(A.head_backward_transient(cfg, x))
        else:
            loss_t.append(0)
        chunk_params = chunk_param_count(params, spec)
        if tied_copy and (spec.has_embedding or spec.has_head):  # its gradient waits in the fp32 accumulator
            chunk_params -= wte  # until the sync after the schedule (model/tied.py)
        if x.autocast:  # made by the step's first forward, freed after its last backward (weight_grad.py)
            copies += 2 * A.autocast_weights(cfg, x, len(spec.layers), spec.has_head)
        per_micro.append(held)
        grad_t.append(layer_t + st.backward - released)
        grads.append(st.step_grads * chunk_params // total_params)
    acts_and_grads, moment = peak_activations(
        lay.schedule, lay.pp, lay.vpp, lay.accumulation, pp_rank, per_micro, loss_t, grad_t, grads, st.bucket_held
    )
    acts_and_grads += st.step_held + copies
    step_grads = sum(g for done, g in zip(moment.grads, grads) if done)
    # after the backwards: ZeRO-2's last reduction (bucket and copies); the tied embedding's sync (an extra
    # backward of the weight), then the optimizer step with its temporaries
    tied_sync = wte * (2 if bf16 else 4) if tied_copy else 0
    after = {
        "gradient reduction": st.step_grads + st.backward + st.reduce,
        "optimizer step": st.step_grads + st.bucket_held + max(st.step, tied_sync),
    }
    phase = max(after, key=after.get)
    common = dict(
        pp_rank=pp_rank,
        params=st.params,
        grads=st.grads,
        optimizer=st.optimizer,
        buffers=buffers,
        host=st.host,
        host_optimizer=st.host_optimizer,
        host_params=st.host_params,
        held=most_held(lay.schedule, lay.pp, lay.vpp, lay.accumulation, pp_rank, per_micro) + copies,
    )
    if after[phase] > acts_and_grads:
        held_grads = st.step_grads + (st.bucket_held if phase == "optimizer step" else 0)
        return RankMemory(**common, activations=0, step_grads=held_grads, step=after[phase] - held_grads, phase=phase)
    return RankMemory(
        **common,
        activations=acts_and_grads - step_grads,
        step_grads=step_grads,
        step=0,
        phase="backward" if moment.backward is not None else "forward",
    )
