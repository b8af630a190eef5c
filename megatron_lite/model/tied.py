"""Tied embeddings split over two pipeline stages: the first stage looks tokens up in `wte`, the last projects
onto it, and each holds its own copy. The copies start equal; to stay equal each must be updated with the sum
of both stages' gradients.

The sum cannot happen inside the schedule's backwards (the two stages finish at different times), and it
must not happen after DeepSpeed has already reduced and partitioned the gradient: ZeRO-2 reduce-scatters
over DP inside every backward (Megatron-LM #844 is the bug this ordering causes). So neither copy takes part
in the schedule's graphs: each forward uses a detached stand-in whose gradient accumulates here in fp32. After
the last micro-batch the two buffers are all-reduced over the embedding group and the sum enters DeepSpeed
through one extra backward of the weight itself, `GPT.forward(None, chunk=GPT.TIED_WEIGHT)`, so every ZeRO
stage reduces, partitions and clips it as it does any gradient.

The last stage's copy is marked `ds_pipe_replicated` so that gradient norms count the weight once.
`tie_across_stages` decides whether a rank's model needs this and installs it (build_model calls it); in a V
(zbv) both ends sit on rank 0 and share one weight, so nothing is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_lite.model.gpt import GPT


def tie_across_stages(model: GPT, embed_group, pp_rank: int, pp_size: int) -> GPT:
    """Set model.tied when this rank holds one end of a tied embedding and another rank holds the other."""
    if needs_tie(model):
        model.tied = TiedEmbedding(model.wte.weight, embed_group, is_head_copy=pp_rank == pp_size - 1)
    return model


def needs_tie(model: GPT) -> bool:
    """Whether model holds one end of a tied embedding only (so it cannot train without model.tied)."""
    first, last = any(c.has_embedding for c in model.chunks), any(c.has_head for c in model.chunks)
    return model.cfg.tie_embeddings and first != last


class TiedEmbedding:
    def __init__(self, weight: torch.nn.Parameter, embed_group, is_head_copy: bool):
        self.weight, self.embed_group = weight, embed_group
        self.grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # fp32 accumulation
        if is_head_copy:
            weight.ds_pipe_replicated = True

    def stand_in(self) -> torch.Tensor:
        """The weight's values, as a fresh leaf whose gradient lands in self.grad instead of the parameter."""
        leaf = self.weight.detach().requires_grad_(torch.is_grad_enabled())
        if leaf.requires_grad:
            leaf.register_post_accumulate_grad_hook(self._accumulate)
        return leaf

    def _accumulate(self, leaf: torch.Tensor) -> None:
        """Add the stand-in's gradient to self.grad and drop it from the leaf. (A hook on the gradient itself
        left autograd to store it in leaf.grad too: a weight-sized fp32 tensor that lived as long as the
        micro-batch's graph, under 1F1B into the next micro-batch's backward.)"""
        self.grad.add_(leaf.grad)
        leaf.grad = None

    def sync(self, forward: Callable) -> None:
        """Sum both copies' gradients and hand the sum to the parameter. forward: the engine's forward."""
        dist.all_reduce(self.grad, group=self.embed_group)
        weight_out = forward(None, chunk=GPT.TIED_WEIGHT)
        torch.autograd.backward(weight_out, self.grad.to(weight_out.dtype))
        self.grad.zero_()
