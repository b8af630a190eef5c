"""tools/bench_kernels.py times an op's forward + backward and nothing else: no work in a leaf's AccumulateGrad, which
cloned cross entropy's gradient (written over its logits) and added rope's into the base of its view on every
timed call, and no .grad written (CPU interpreter)."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_a_timed_backward_runs_no_gradient_accumulation():
    from torch.profiler import ProfilerActivity, profile

    from tools.bench_kernels import cases, run_case

    seen = []
    for name, fused, reference, inputs, _, _ in cases(64, 96, 160, 4, 1000, torch.float32, torch.device("cpu")):
        leaves = [t._base if t._base is not None else t for t in inputs if isinstance(t, torch.Tensor)]
        for fn in (fused, reference):
            step = run_case(fn, inputs, backward=True)
            step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            # autograd.grad still lists the leaves' AccumulateGrad nodes, but runs nothing under them
            accumulated = [e.name for e in prof.events() if e.cpu_parent and "AccumulateGrad" in e.cpu_parent.name]
            assert not accumulated, f"{name}: the timed step accumulates gradients: {accumulated[:3]}"
            assert all(t.grad is None for t in leaves), f"{name}: a .grad was written"
        seen.append(name)
    assert seen == ["rmsnorm", "layernorm", "rope", "swiglu", "bias_gelu", "cross_entropy"]
