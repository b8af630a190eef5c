"""One executor for every schedule: it runs a rank's action list (pipeline/schedules.py) step by step.

  Compute F(mb, chunk)   forward of this rank's chunk on micro-batch mb; the input is the token batch on the
                         first virtual stage, else the activation received for it; on the last virtual stage
                         the output is the micro-batch loss, kept (divided by m) for its backward
  Compute B(mb, chunk)   backward from the loss (last stage) or from the received output gradient; keeps the
                         input gradient for the previous stage. In a zero-bubble schedule only that: the
                         weight gradients are queued for W (parallel/weight_grad.py)
  Compute W(mb, chunk)   the weight gradients B(mb, chunk) queued, accumulated into .grad; one backward
                         through the forward callable (forward(None, chunk=WEIGHT_GRADS)), as B's are
  Comm(ops)              one batch_isend_irecv of every op, all waited before the next step: the schedule
                         placed sends and receives so that this cannot deadlock (its simulator checks it)

Messages carry no shape handshake: every activation and gradient is (micro_batch, s, h), or (micro_batch,
s/tp, h) under sequence parallelism, so receivers allocate their buffers up front. pp = 1 runs through here
too: its schedule is F0 B0 F1 B1 ... with no Comm steps. Where the next virtual stage is this rank's own
other chunk (pp = 1, the turn of zbv's V), the output and the input gradient are handed over in memory.

With data.document_mask a micro-batch is data.documents.Windows (tokens and each token's position in its
document): every chunk's forward gets it as `documents`, since every block masks its attention by it and the head
its loss. Each pipeline rank reads its micro-batches from the data itself (as it reads the labels), so the
documents travel with each micro-batch without growing any message.

Each forward gets its micro-batch's dropout key, `rng_key` = (step, index in the global batch), from the
caller: masks depend on which micro-batch runs, never on when (parallel/random.py), so every schedule trains
like the single process with dropout on.

Gradients are scaled once, at the loss (1/m over the m micro-batches of this rank's step); the DeepSpeed engine
is configured with one accumulation step and unmanaged accumulation, so it neither rescales each chunk's output
gradient nor steps early: the optimizer step comes after the whole schedule (engine.py).

A chunk's output is needed after its send only as the root of its backward graph: autograd keeps what the
backward reads (saved tensors, the graph), not the output's values. So once the send has completed, the output's
storage is swapped for one element (Megatron's deallocation) and its backward runs through autograd's engine
directly, which checks the gradient against the shape recorded at forward time instead of the tensor's current
shape. That frees one (b, s, h) activation per micro-batch in flight, up to pp·vpp of them on the first rank of
1F1B. Outputs that are views or leaves keep their storage (their data may be someone else's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from megatron_lite.data.documents import Windows
from megatron_lite.parallel import weight_grad
from megatron_lite.pipeline.partition import ChunkSpec
from megatron_lite.pipeline.schedules import SPLIT_BACKWARD, Comm, Compute, build_schedule, v_shaped


@dataclass
class StepStats:
    loss: torch.Tensor | None  # mean micro-batch loss, on ranks holding the last virtual stage; else None
    wait_s: float = 0.0  # seconds blocked in p2p waits (idle time at the end of the schedule not included)
    busy_s: float = 0.0  # seconds in forward/backward compute
    wall_s: float = 0.0  # seconds from the schedule's first step to its last on this rank
    timeline: list = field(default_factory=list)  # (start, end, kind, microbatch, chunk), when recorded
    peak_kept_bytes: int = 0  # most bytes held at once by chunk outputs waiting for their backward (not counting
    #                            one handed to this rank's next chunk: that chunk's input shares its storage)


def forward_only(schedule: list) -> list:
    """The forward half of a schedule (validation): F steps and the activation messages, in the same order."""
    out = []
    for step in schedule:
        if isinstance(step, Compute):
            if step.kind == "F":
                out.append(step)
        else:
            ops = tuple(op for op in step.ops if op.kind == "act")
            if ops:
                out.append(Comm(ops))
    return out


class PipelineExecutor:
    def __init__(
        self,
        chunks: list[ChunkSpec],
        schedule: str,
        pp: int,
        pp_rank: int,
        act_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        peer_rank: Callable[[int], int],
        pp_group,
    ):
        """chunks: this rank's ChunkSpecs (vpp of them); schedule: a resolved schedule name; act_shape:
        (micro_batch, s_local, h); peer_rank: pipeline rank -> global rank."""
        self.chunks, self.schedule_name, self.pp, self.pp_rank = chunks, schedule, pp, pp_rank
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.peer_rank, self.pp_group = peer_rank, pp_group
        self.local_chunk = {spec.virtual_stage: spec.chunk for spec in chunks}  # virtual stage -> chunk held here
        self.record_timeline = False
        self._schedules: dict[tuple[bool, int], list] = {}

    def schedule(self, train: bool, m: int) -> list:
        """This rank's steps for m micro-batches: the configured schedule to train, GPipe's forward half to
        evaluate (any m, no backward to interleave with)."""
        if (train, m) not in self._schedules:
            name = self.schedule_name if train else "gpipe"
            v_shape = v_shaped(self.schedule_name)  # the chunks' placement, whichever schedule runs them
            steps = build_schedule(name, self.pp, len(self.chunks), m, v_shape)[self.pp_rank]
            self._schedules[(train, m)] = steps if train else forward_only(steps)
        return self._schedules[(train, m)]

    def run(
        self,
        forward: Callable,
        micro_batches: list[torch.Tensor],
        train: bool = True,
        before_backward: Callable[[], None] | None = None,
        rng_keys: list[tuple[int, int]] | None = None,
        weight_forward: Callable | None = None,
    ) -> StepStats:
        """Run the schedule over micro_batches (each (b, s+1) tokens; m of them, the same m on every rank).
        forward(inputs, labels, chunk=k, rng_key=rng_keys[mb]) is the engine's forward (rng_key None without
        rng_keys: no dropout expected, e.g. in eval); before_backward() runs before each backward (see
        engine.py). weight_forward (default: forward) is what W steps call, forward(None, chunk=WEIGHT_GRADS).
        Returns this rank's mean loss (last stage) and timings; gradients are left accumulated for the optimizer
        step."""
        stats = StepStats(loss=None)
        split = train and self.schedule_name in SPLIT_BACKWARD
        store, weight_forward = weight_grad.WeightGradStore(), weight_forward or forward
        n_micro = len(micro_batches)
        assert rng_keys is None or len(rng_keys) == n_micro, (len(rng_keys), n_micro)
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> the chunk's input (needs its grad)
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> output, or scaled loss on the last stage
        inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, chunk) -> received tensor
        outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, chunk) -> tensor to send
        losses = []
        start = time.perf_counter()
        with torch.set_grad_enabled(train), weight_grad.split(store) if split else contextlib.nullcontext():
            for step in self.schedule(train, n_micro):
                t0 = time.perf_counter()
                if isinstance(step, Comm):
                    stats.wait_s += self._exchange(step, inbox, outbox, outputs)
                    continue
                mb, k = step.microbatch, step.chunk
                spec = self.chunks[k]
                if step.kind == "F":
                    self._run_forward(
                        forward,
                        spec,
                        mb,
                        n_micro,
                        micro_batches[mb],
                        train,
                        inputs,
                        outputs,
                        inbox,
                        outbox,
                        losses,
                        rng_keys[mb] if rng_keys is not None else None,
                    )
                elif step.kind == "B" and not split:
                    self._run_backward(mb, spec, outputs, inbox, inputs, outbox, before_backward)
                elif step.kind == "B":
                    with store.collecting((mb, k)):
                        self._run_backward(mb, spec, outputs, inbox, inputs, outbox, before_backward)
                    # recomputed blocks made their weight gradients in this B: handed over now
                    self._run_weight_grads(weight_forward, store, mb, k, before_backward, after_b=True)
                else:
                    self._run_weight_grads(weight_forward, store, mb, k, before_backward)
                t1 = time.perf_counter()
                stats.busy_s += t1 - t0
                kept = sum(
                    o.untyped_storage().nbytes()
                    for (_, chunk), o in outputs.items()
                    if self.chunks[chunk].virtual_stage + 1 not in self.local_chunk
                )
                stats.peak_kept_bytes = max(stats.peak_kept_bytes, kept)
                if self.record_timeline:
                    stats.timeline.append((t0, t1, step.kind, mb, k))
        stats.wall_s = time.perf_counter() - start
        assert not outputs and not inbox and not outbox and store.empty(), "schedule left work undone"
        if losses:
            stats.loss = torch.stack(losses).mean()
        return stats

    def _forward(self, forward, spec: ChunkSpec, batch: torch.Tensor, received, train: bool, inputs, mb, rng_key):
        batch = batch.to(self.device, non_blocking=True)
        documents = batch if isinstance(batch, Windows) else None
        if documents is not None:
            batch = documents.tokens
        labels = batch[:, 1:] if spec.has_head else None
        if spec.has_embedding:
            x = batch[:, :-1]
        else:
            x = received
            if train:
                x.requires_grad_()
                inputs[(mb, spec.chunk)] = x
        if documents is None:
            return forward(x, labels, chunk=spec.chunk, rng_key=rng_key)
        return forward(x, labels, chunk=spec.chunk, rng_key=rng_key, documents=documents)

    def _run_forward(
        self,
        forward,
        spec: ChunkSpec,
        mb: int,
        n_micro: int,
        batch,
        train: bool,
        inputs,
        outputs,
        inbox,
        outbox,
        losses: list,
        rng_key,
    ) -> None:
        """Forward of chunk `spec` for micro-batch mb: the loss kept (scaled 1/m) on the last stage, else the
        output queued for its send. A method of its own so that no local keeps the output's graph (and through
        it the chunk's received input) alive after the backward has run (see _run_backward)."""
        out = self._forward(forward, spec, batch, inbox.pop(("act", mb, spec.chunk), None), train, inputs, mb, rng_key)
        if spec.has_head:
            losses.append(out.detach().float())
            if train:
                outputs[(mb, spec.chunk)] = out / n_micro
        else:
            local = self.local_chunk.get(spec.virtual_stage + 1)
            if local is not None:  # the next stage is on this rank
                inbox[("act", mb, local)] = out.detach()
            else:
                outbox[("act", mb, spec.chunk)] = out.detach()
            if train:
                outputs[(mb, spec.chunk)] = out

    def _run_backward(self, mb: int, spec: ChunkSpec, outputs, inbox, inputs, outbox, before_backward) -> None:
        """Backward of chunk `spec` for micro-batch mb; its input's gradient goes to the outbox. A method of its
        own so that the output, the received gradient and the input are let go on return (held in the loop's
        locals, they kept one more activation alive through the next forward)."""
        out = outputs.pop((mb, spec.chunk))
        grad = None if spec.has_head else inbox.pop(("grad", mb, spec.chunk))
        if before_backward is not None:
            before_backward()
        _backward(out, grad)
        x = inputs.pop((mb, spec.chunk), None)
        if x is not None:
            local = self.local_chunk.get(spec.virtual_stage - 1)
            if local is not None:  # the previous stage is on this rank
                inbox[("grad", mb, local)] = x.grad
            else:
                outbox[("grad", mb, spec.chunk)] = x.grad

    @staticmethod
    def _run_weight_grads(forward, store, mb: int, chunk: int, before_backward, after_b: bool = False) -> None:
        """W of chunk `chunk` for micro-batch mb: the work its B queued, run as one backward (after_b: the
        gradients that B computed itself, parallel/weight_grad.py). Nothing queued, nothing runs: no forward
        through the engine after every B of a run without recomputation."""
        if store.nothing_queued((mb, chunk), after_b):
            return
        with store.releasing((mb, chunk), after_b):
            out = forward(None, chunk=weight_grad.WEIGHT_GRADS)
        if before_backward is not None:
            before_backward()
        torch.autograd.backward(out)

    def _exchange(self, comm: Comm, inbox: dict, outbox: dict, outputs: dict) -> float:
        """Post every op of one Comm step together and wait for all; return the seconds spent waiting. A sent
        activation's output then gives up its storage (module docstring)."""
        ops, arrivals = [], []
        for op in comm.ops:
            key = (op.kind, op.microbatch, op.chunk)
            if op.op == "send":
                tensor = outbox.pop(key).contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, self.peer_rank(op.peer), self.pp_group))
            else:
                tensor = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, tensor, self.peer_rank(op.peer), self.pp_group))
                arrivals.append((key, tensor))
        t0 = time.perf_counter()
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        waited = time.perf_counter() - t0
        for key, tensor in arrivals:
            inbox[key] = tensor
        for op in comm.ops:
            out = outputs.get((op.microbatch, op.chunk)) if op.op == "send" and op.kind == "act" else None
            if out is not None and out.grad_fn is not None and out._base is None:
                out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
        return waited


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """torch.autograd.backward(out, grad) without its check that grad has out's current shape: out may have
    given up its storage after its send (module docstring); the engine checks grad against the forward's shape."""
    if grad is None:
        torch.autograd.backward(out)
        return
    Variable._execution_engine.run_backward(
        tensors=(out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
