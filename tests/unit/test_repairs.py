"""DeepSpeed 0.19 repairs that one optimizer shows without a process group (engine/repairs/)."""

import copy

import pytest
import torch

from megatron_lite.engine.repairs import replay_cpu_adam_beta_powers


@pytest.mark.parametrize("resume_at", [4, 7])
def test_cpu_adam_resumed_updates_bitwise_as_the_uninterrupted_one(resume_at):
    """DeepSpeed's CPU Adam (CPU and NVMe optimizer offload) resumed at step t from the uninterrupted one's state:
    with replay_cpu_adam_beta_powers its next five updates equal the uninterrupted optimizer's bit for bit. Its C++
    object keeps beta^t as a running float32 product; a fresh one computes pow(beta, t) at its first step, which
    differs in the last bit at some t (beta2 = 0.95: at t = 7 the updates differ, at t = 4 not: shown below)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen) for _ in range(resume_at + 5)]

    def optimizer(weights: torch.Tensor) -> tuple[torch.Tensor, DeepSpeedCPUAdam]:
        param = torch.nn.Parameter(weights.clone())
        return param, DeepSpeedCPUAdam([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)

    straight, adam = optimizer(torch.randn(4096, generator=gen))
    for grad in grads[:resume_at]:
        straight.grad = grad.clone()
        adam.step()
    resumed = {}
    for repaired in (True, False):
        param, fresh = optimizer(straight.detach())
        fresh.load_state_dict(copy.deepcopy(adam.state_dict()))  # (as from a file: its own moments)
        if repaired:
            replay_cpu_adam_beta_powers(fresh)
        resumed[repaired] = (param, fresh)
    same_without = True
    for grad in grads[resume_at:]:
        for param, opt in [(straight, adam), *resumed.values()]:
            param.grad = grad.clone()
            opt.step()
        assert torch.equal(resumed[True][0], straight), f"resumed at step {resume_at}: updates differ"
        same_without &= torch.equal(resumed[False][0], straight)
    assert same_without == (resume_at == 4)  # the defect the repair is for, where it shows
