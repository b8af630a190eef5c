"""The backward split in two for zero-bubble pipelines: B (input gradients) now, W (weight gradients) later.

A layer's backward computes two things: the gradient w.r.t. its input, which the previous pipeline stage is
waiting for, and the gradient w.r.t. its weights, which nobody needs before the optimizer step. Zero-bubble
schedules (Qi et al. 2024) run the first as B and queue the second as W, to fill the pipeline's idle slots.

How, here: the ops that touch a parameter go through this module's functions. Outside a split step they are
plain torch (`F.linear`, `F.embedding`, the parameter itself), so every other schedule runs unchanged; one
exception in every schedule: under ZeRO-0's bf16 autocast a linear makes its weight gradients in fp32 from the
bf16 operands (`linear_weight_grads`) instead of rounding them to bf16 first, and multiplies the step's one bf16
copy of its weight (`one_copy_per_step`).
Inside `split(store)` (the pipeline executor, for the whole of a zero-bubble step) they take stand-ins for
their weights (fresh leaves holding the same values, as the tied embedding's, model/tied.py), so the step's
graphs have no edge into any weight: a B, run under `store.collecting(key)` (the
executor's B of micro-batch mb, chunk k), computes input gradients and touches no parameter, no `.grad` and
no ZeRO hook. Each op hands the store a closure for its weight gradient instead:

  linear(x, w, b)     B: dx = g w;  W: dw = g^T x, db = sum(g)  -- the matmul that is half a layer's backward
  embedding(t, w)     B: nothing (tokens have no gradient);  W: dw = scatter-add of g over the tokens
  held(p)             B: p's gradient, computed with the input gradient by the op that uses p (a norm's
                      gain, a bias); W: handed over. One pass over the activations yields both, so computing
                      it again in W would only read them twice; holding it keeps ZeRO's gradient hooks in W.

W is one autograd backward of a graph output whose inputs are every weight tensor the
queued closures feed (`store.releasing(key)`, `released_output()`: the model's forward returns it for
chunk=WEIGHT_GRADS, so that DeepSpeed's backward hooks open and close W as any backward): autograd sums a parameter's contributions and accumulates each once into `.grad`,
running ZeRO-1/2's gradient hooks, the tied embedding's fp32 hook and the TP all-reduce of sequence-parallel
gains (`copy_to_tp`) exactly as a whole backward would. The accumulation order over micro-batches is the B
order of 1F1B, so gradients equal 1F1B's (and the single process's) to fp32 rounding of reordered sums.

Recomputed regions (`recompute`) run under `kept_in_backward()`: their ops compute weight gradients in B,
as plain torch does, on stand-ins, and the executor hands those gradients over right after that B, in a W
of their own (`releasing(key, after_b=True)`). Deferring their W would hold every linear's input and output
gradient per micro-batch -- the activations recomputation was chosen not to keep; and handing gradients to
the parameters inside B would run ZeRO's hooks outside any backward DeepSpeed opened. The LM head takes its
weight through held(): its gradient is made in B and kept until W (vocab x h), where a deferred matmul would
keep the logits' gradient (b x s x vocab, larger whenever b*s > h) for every micro-batch waiting for W.

Left out on purpose: deferring inside torch.compile'd graphs (the split path is excluded from compilation, so
under train.compile the linears and embeddings run eagerly between compiled regions); ZeRO-3 (a partitioned
parameter cannot take a gradient after its module's backward has released it; refused in validation/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron_lite.parallel.fp8 import Float8Matmul, autocast_dtype
from megatron_lite.parallel.fp8 import linear as fp8_linear

Key = tuple[int, int]  # (micro-batch, chunk)
WEIGHT_GRADS = -2  # model.forward(None, chunk=WEIGHT_GRADS): the released W work as a graph output


@dataclass
class _Deferred:
    """One op's weight-gradient work: the tensors its forward took as weights and the closure computing their
    gradients (None where a weight is absent, e.g. no bias)."""

    weights: tuple[torch.Tensor | None, ...]
    compute: Callable[[], tuple[torch.Tensor | None, ...]]


@dataclass
class WeightGradStore:
    """One pipeline rank's queued W work, by (micro-batch, chunk)."""

    pending: dict[Key, list[_Deferred]] = field(default_factory=dict)  # W's work
    after_b: dict[Key, list[_Deferred]] = field(default_factory=dict)  # gradients B made, handed over next
    collecting_key: Key | None = None
    released: tuple[dict, Key] | None = None  # (pending or after_b, key) while a W runs

    @contextlib.contextmanager
    def collecting(self, key: Key):
        """Queue the W work of backwards run inside this block under `key` (the executor's B)."""
        assert self.collecting_key is None, f"B of {key} inside B of {self.collecting_key}"
        self.collecting_key = key
        self.pending.setdefault(key, [])
        self.after_b.setdefault(key, [])
        try:
            yield
        finally:
            self.collecting_key = None

    def defer(self, weights: tuple[torch.Tensor | None, ...], compute: Callable, after_b: bool = False) -> None:
        """Queue compute() for the B being collected: for its W, or (after_b) for right after it."""
        assert self.collecting_key is not None, "a split step's forward was backpropagated outside its B step"
        (self.after_b if after_b else self.pending)[self.collecting_key].append(_Deferred(weights, compute))

    @contextlib.contextmanager
    def releasing(self, key: Key, after_b: bool = False):
        """W of `key` (after_b: the gradients its B computed): inside this block, released_output() hands out
        that work (the executor's W step, or the hand-over that follows a B)."""
        self.released = (self.after_b if after_b else self.pending, key)
        try:
            yield
        finally:
            self.released = None

    def nothing_queued(self, key: Key, after_b: bool = False) -> bool:
        """Whether B queued no work for this W (its entry is then dropped): the executor skips the W."""
        queue = self.after_b if after_b else self.pending
        if any(w is not None for item in queue[key] for w in item.weights):
            return False
        del queue[key]
        return True

    def weight_output(self) -> torch.Tensor:
        """The released work: a scalar graph output whose backward computes the queued weight gradients and
        accumulates them into their weights (zero with no graph when B queued nothing)."""
        queue, key = self.released
        work = queue.pop(key)
        weights = tuple(w for item in work for w in item.weights if w is not None)
        if not weights:
            return torch.zeros(())
        return _WeightGrads.apply(work, *weights)

    def empty(self) -> bool:
        return not self.pending and not self.after_b


class _WeightGrads(torch.autograd.Function):
    """Graph output of a W step; its backward runs the queued closures and returns their gradients."""

    @staticmethod
    def forward(ctx, work, *weights):
        ctx.work = work
        return torch.zeros((), device=weights[0].device)

    @staticmethod
    def backward(ctx, _):
        grads = []
        for item in ctx.work:
            grads += [g for w, g in zip(item.weights, item.compute()) if w is not None]
        ctx.work = None
        return (None, *grads)


_split_store: WeightGradStore | None = None  # set by `split` for the length of a zero-bubble step
_kept = False  # set by `kept_in_backward`: ops compute their weight gradients in B


@contextlib.contextmanager
def split(store: WeightGradStore):
    """Ops run inside this block (forwards) defer their weight gradients to `store` when their backward runs
    under store.collecting. A mode scoped like torch.autocast, entered by the executor for one step."""
    global _split_store
    previous, _split_store = _split_store, store
    try:
        yield
    finally:
        _split_store = previous


@contextlib.contextmanager
def kept_in_backward():
    """Ops run inside this block compute their weight gradients in B (recomputed regions); in a split step,
    on stand-ins whose gradients the executor hands over right after that B."""
    global _kept
    previous, _kept = _kept, True
    try:
        yield
    finally:
        _kept = previous


def released_output() -> torch.Tensor:
    """The W work released by the executor (WeightGradStore.released), for the model's forward."""
    assert _split_store is not None and _split_store.released is not None, "no W step is running"
    return _split_store.weight_output()


def active_store() -> WeightGradStore | None:
    """The store of the split step running now, if gradients are being recorded; else None."""
    return _split_store if torch.is_grad_enabled() else None


def kept() -> bool:
    """Whether ops run now compute their weight gradients in B (inside kept_in_backward)."""
    return _kept


_copies: dict | None = None  # set by `one_copy_per_step`: weight's place and dtype -> (its version, copy, weight)


@contextlib.contextmanager
def one_copy_per_step():
    """Inside this block a weight is cast to autocast's dtype once (`weight_as`), and that copy serves every
    forward, backward and recomputation of it until the block ends. Engine.train_step enters it for a step's
    whole schedule under ZeRO-0's bf16 autocast, whose fp32 weights change only in the optimizer step after it.

    Without it a step made a copy per micro-batch: autocast's own cache lives for one forward, the recomputed
    forward in backward casts again, and each micro-batch's backward keeps its own copy alive. At m micro-batches
    that is m casts of every weight a step (6 bytes a parameter each, fp32 read and bf16 written: 7.9 GB at
    gpt-1.3b) and, in a pipeline, one bf16 copy of the chunk's weights per micro-batch in flight; here it is one
    of each, as Megatron-LM's bf16 model weights are. Values are the same casts, so training is bit for bit the
    same (tests/unit/test_weight_grad.py)."""
    global _copies
    previous, _copies = _copies, {}
    try:
        yield
    finally:
        _copies = previous


def weight_as(weight: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """weight (a parameter or a stand-in for one) in dtype, without a graph: inside one_copy_per_step the
    step's copy, made on first use; else a fresh cast. None or already in dtype: itself."""
    if weight is None or dtype is None or weight.dtype == dtype:
        return weight
    if torch.compiler.is_compiling() or _copies is None:  # (compiled graphs fuse their casts)
        return weight.detach().to(dtype)
    # keyed by where the values live, so that a stand-in (a detached view of the parameter, sharing its
    # version counter) finds the parameter's copy; the entry holds the weight, so the place is not reused
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), weight.shape, weight.stride(), dtype)
    hit = _copies.get(key)
    if hit is not None and hit[0] == weight._version:
        return hit[1]
    copy = weight.detach().to(dtype)
    _copies[key] = (weight._version, copy, weight)
    return copy


def stand_in(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh leaf with weight's values: a split op's graph input (the output needs one that requires grad,
    e.g. an embedding, whose other input is tokens), never given a gradient."""
    return weight.detach().requires_grad_() if weight is not None else None


_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()  # torch >= 2.8: bf16 operands, fp32 product on CUDA


def linear_weight_grads(
    grad_out: torch.Tensor, x: torch.Tensor, param_dtype: torch.dtype, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's dW = g^T x (out, in) and db = sum of g (out,) over every token, in the parameters' dtype.

    Under ZeRO-0's bf16 autocast the operands are bf16 and the parameters fp32. Autocast's own linear rounds
    dW to bf16 and autograd then casts it to fp32: a pass over every weight gradient, and each micro-batch's
    gradient rounded to bf16 before its fp32 accumulation. Here the matmul makes the fp32 product itself (on
    CUDA: cuBLAS accumulates in fp32 and writes it; on a CPU: fp32 copies of the operands, whose products are
    exact), and db is summed into fp32, as Megatron-LM's gradient-accumulation fusion does into its main_grad.
    Inside torch.compile the product is one op the graph calls (weight_grad_fp32): the traced backward runs under
    autocast, which would multiply in bf16, and mm's out_dtype does not trace (pytorch/pytorch#163275)."""
    g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])  # (N, out), (N, in)
    if g2.dtype == param_dtype:
        dw = g2.t().mm(x2)
    elif torch.compiler.is_compiling():
        dw = torch.ops.megatron_lite.weight_grad_fp32(g2, x2).to(param_dtype)
    else:
        dw = _product_in(param_dtype, g2, x2)
    return dw, g2.sum(0, dtype=param_dtype) if has_bias else None


def _product_in(dtype: torch.dtype, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """g2^T x2 in `dtype` from operands of another (eager only: see linear_weight_grads)."""
    if not g2.is_cuda:
        return g2.t().to(dtype).mm(x2.to(dtype))
    if _MM_OUT_DTYPE:
        return torch.mm(g2.t(), x2, out_dtype=dtype)
    return g2.t().mm(x2).to(dtype)  # an older torch: autocast's rounding


@torch.library.custom_op("megatron_lite::weight_grad_fp32", mutates_args=())
def _weight_grad_fp32(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """linear_weight_grads' fp32 product as an op that torch.compile calls without tracing into it: it runs
    outside the traced autocast, and mm's out_dtype on CUDA is not traceable (pytorch/pytorch#163275)."""
    return _product_in(torch.float32, g2, x2)


@_weight_grad_fp32.register_fake
def _(g2, x2):
    return g2.new_empty((g2.shape[1], x2.shape[1]), dtype=torch.float32)


class _Linear(torch.autograd.Function):
    """x W^T + b under autocast with parameters of another dtype, its weight gradients made in theirs
    (linear_weight_grads). In a split step (store given): on stand-ins of `weights`, and backward returns dx
    and queues (dW, db) against `weights`; otherwise on the parameters themselves, and backward returns all."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, weights):
        dtype = autocast_dtype(x.device.type)  # do what autocast's own linear does: multiply in its dtype
        x_c = x.to(dtype) if dtype is not None else x
        w_c, b_c = weight_as(weight, dtype), weight_as(bias, dtype)
        ctx.save_for_backward(x_c, w_c)
        ctx.store, ctx.weights = store, weights
        return F.linear(x_c, w_c, b_c)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        param_dtype, has_bias = ctx.weights[0].dtype, ctx.weights[1] is not None
        weight_grads = lambda: linear_weight_grads(grad_out, x, param_dtype, has_bias)  # noqa: E731
        if ctx.store is None:
            return grad_out.matmul(w), *weight_grads(), None, None
        ctx.store.defer(ctx.weights, weight_grads)
        return grad_out.matmul(w), None, None, None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, store, weights):
        ctx.save_for_backward(tokens)
        ctx.store, ctx.weights, ctx.rows = store, weights, weight.shape[0]
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        # what F.embedding's own backward computes
        ctx.store.defer(
            ctx.weights, lambda: (torch.ops.aten.embedding_backward(grad_out, tokens, ctx.rows, -1, False, False),)
        )
        return None, None, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fp8: Float8Matmul | None = None
) -> torch.Tensor:
    """F.linear; in a split step its weight gradients wait for W. Weight gradients in the parameters' dtype
    (_linear_now). fp8: the projection's float8 matmul (train.fp8, parallel/fp8.py), split as this one."""
    store = active_store()
    if fp8 is not None:
        if store is None:
            return fp8_linear(x, weight, bias, fp8)
        if _kept:
            return fp8_linear(x, _after_b_stand_in(weight, store), _after_b_stand_in(bias, store), fp8)
        return _split_op(fp8_linear, x, stand_in(weight), stand_in(bias), fp8, store, (weight, bias))
    if store is None:
        return _linear_now(x, weight, bias)
    if _kept:
        return _linear_now(x, _after_b_stand_in(weight, store), _after_b_stand_in(bias, store))
    return _split_op(_Linear.apply, x, stand_in(weight), stand_in(bias), store, (weight, bias))


def head_linear(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head's h W^T (no bias). In a split step its weight gradient is made in B and held for W (held()):
    a W of its own would keep the logits' gradient, (b, s, vocab), for every micro-batch waiting."""
    return _linear_now(h, held(weight), None)


def _linear_now(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with its gradients made in its backward. Under autocast with parameters of another dtype
    (ZeRO-0's bf16) the weight gradients are made in the parameters' dtype (linear_weight_grads), inside
    torch.compile too: its graphs trace _Linear (casts fused as autocast's would be) and call the product as
    one op, so compiled and eager blocks give the same gradients (autocast's own linear makes bf16 weight
    gradients, 2-3e-3 from these once cast to fp32: tests/unit/test_weight_grad.py)."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None or dtype == weight.dtype:
        return F.linear(x, weight, bias)
    if weight.requires_grad and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias, None, (weight, bias))
    # no graph (evaluation, a recomputed region's first forward): inside a step its copies, which the rerun reuses
    return F.linear(x, weight_as(weight, dtype), weight_as(bias, dtype))


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding; in a split step its weight gradient waits for W."""
    store = active_store()
    if store is None:
        return F.embedding(tokens, weight)
    if _kept:
        return F.embedding(tokens, _after_b_stand_in(weight, store))
    return _split_op(_Embedding.apply, tokens, stand_in(weight), store, (weight,))


def held(param: torch.Tensor | None) -> torch.Tensor | None:
    """param as an op uses it; in a split step a stand-in whose gradient, computed in B, is queued for W."""
    store = active_store()
    if store is None or param is None:
        return param
    return _after_b_stand_in(param, store) if _kept else _held_stand_in(param, store)


def _held_stand_in(param: torch.Tensor, store: WeightGradStore, after_b: bool = False) -> torch.Tensor:
    leaf = stand_in(param)
    leaf.register_hook(lambda grad: store.defer((param,), lambda: (grad,), after_b))
    return leaf


def _after_b_stand_in(param: torch.Tensor | None, store: WeightGradStore) -> torch.Tensor | None:
    return None if param is None else _held_stand_in(param, store, after_b=True)


def _split_op(op, *args):
    """op(*args): a split step's deferring op (compiled graphs leave it out: run_eagerly_under_compile)."""
    return op(*args)


def run_eagerly_under_compile() -> None:
    """Exclude the deferring ops from torch.compile (torch.compiler.disable): under train.compile they run
    eagerly between the compiled parts. GPT.compile_blocks calls this before anything is traced; it is not
    done at import because the decorator imports torch._dynamo, 1.6 s on every rank of every run."""
    global _held_stand_in, _split_op
    if not getattr(_split_op, "_torchdynamo_disable", False):
        _held_stand_in, _split_op = torch.compiler.disable(_held_stand_in), torch.compiler.disable(_split_op)
