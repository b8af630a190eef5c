"""Our loaders of checkpoint states into a ZeRO 0-3 engine of any layout: from the universal form (made by
checkpoint/universal.py, one full fp32 tensor per parameter and state), and an NVMe-swapped optimizer's from its
own files at the layout it was written with.

Each universal tensor is cut to this rank's TP share as the model's build cuts it (model/init.local_part), then
to its ZeRO partition as DeepSpeed lays it out, and put into the optimizer's per-parameter states; the optimizer's
groups keep this run's hyperparameters. DeepSpeed 0.19's own loaders of the universal form are not used: they cut
TP shards only for its AutoTP layers or by split patterns older checkpoints lack, read files whose names depend on
the saved ZeRO stage, and put the saved groups' settings in place of this run's (each loader says which).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from megatron_lite.engine.ds_checkpoint import rows_and_width, universal_tensor
from megatron_lite.engine.repairs import nvme_checkpoint


def _slots_by_parameter(model) -> dict[int, tuple]:
    """id(parameter) -> (global name, module, attribute) of each parameter this rank holds; a tied weight under
    its first name."""
    from megatron_lite.model.init import parameter_slots

    slots = {}
    for name, module, attr in parameter_slots(model):
        slots.setdefault(id(module._parameters[attr]), (name, module, attr))
    return slots


def _tp_share(zero_dir: str, model, slot: tuple, key: str, shape) -> torch.Tensor:
    """This rank's TP share of the universal form's full `key` tensor (fp32, exp_avg, exp_avg_sq) of the
    parameter in `slot`, cut as the model's build cuts it (model/init.local_part); checked against the `shape`
    the model holds."""
    from megatron_lite.model.init import local_part

    name, module, attr = slot
    part = local_part(module, attr, universal_tensor(zero_dir, name, key, *rows_and_width(model.full_shapes[name])))
    assert part.shape == shape, f"{name}: universal {key} cuts to {tuple(part.shape)}, the model holds {tuple(shape)}"
    return part


@torch.no_grad()
def _load_zero0_universal(engine, zero_dir: str) -> None:
    """A ZeRO-0 engine resuming a checkpoint of another TP size, pipeline layout or ZeRO stage: every parameter
    this rank holds and its AdamW moments and step, from the universal form's full tensors, cut to this rank's
    share as the model's build cuts them (model/init.local_part). Vocabulary rows are re-padded for this tp with zeros (the
    conversion drops the padding; padded rows never get a gradient, so their moments are zero too)."""
    from megatron_lite.model.init import parameter_slots

    model, optimizer = engine.model, engine.optimizer
    position = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}

    step_of = _universal_steps(zero_dir)
    states = {}
    for slot in parameter_slots(model):
        name, module, attr = slot
        param = module._parameters[attr]
        param.copy_(_tp_share(zero_dir, model, slot, "fp32", param.shape))
        states[position[id(param)]] = {
            "step": torch.tensor(step_of(name), dtype=torch.float32),
            **{key: _tp_share(zero_dir, model, slot, key, param.shape).clone() for key in ("exp_avg", "exp_avg_sq")},
        }
    optimizer.load_state_dict({"state": states, "param_groups": optimizer.state_dict()["param_groups"]})


def _universal_steps(zero_dir: str):
    """name -> the optimizer step that parameter of the universal form was saved at: its step.pt, which
    DeepSpeed's converter writes for ZeRO 1-2 and for a TP ZeRO-3 checkpoint (ours for ZeRO-0), else (ZeRO-3 at
    tp 1) the saved optimizer's in zero/optimizer_state.pt, read once per load (the file also holds the saved
    rank's optimizer state)."""

    @functools.cache
    def saved_optimizer_step() -> float:
        saved = torch.load(os.path.join(zero_dir, "optimizer_state.pt"), map_location="cpu", weights_only=False)
        return float(saved["optimizer_state_dict"]["state"][0]["step"])

    def step_of(name: str) -> float:
        own = os.path.join(zero_dir, name, "step.pt")
        if os.path.isfile(own):
            return float(torch.load(own, map_location="cpu", weights_only=False))
        return saved_optimizer_step()

    return step_of


def _one_step(steps: set) -> float:
    assert len(steps) == 1, f"the universal form's parameters were saved at different steps: {sorted(steps)}"
    return next(iter(steps))


def _adam_step(optimizer, master: torch.Tensor, step: float):
    """`step` as this run's optimizer keeps it for the flat partition `master`: DeepSpeed's CPU Adam a Python int,
    torch's AdamW a float32 tensor (on the CPU, or beside its parameter when fused or capturable), whatever
    another optimizer of its class already holds there (ZeRO-3 creates the states at build; ZeRO 1-2 at the
    first step, so they are absent at a load)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    held = optimizer.state[master].get("step")
    if isinstance(held, torch.Tensor):
        return torch.full_like(held, step)
    if held is not None or isinstance(optimizer, DeepSpeedCPUAdam):
        return int(step)
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(step, dtype=torch.float32, device=master.device if on_device else "cpu")


@torch.no_grad()
def _load_zero12_universal(engine, zero_dir: str) -> None:
    """A ZeRO 1-2 engine resuming a checkpoint of another DP, TP or CP size, pipeline layout, ZeRO stage or
    precision: each parameter's fp32 master and Adam moments, from the universal form's full tensors, cut first
    to this rank's TP share (model/init.local_part, as the build cuts) and then to the fragment of it this
    rank's ZeRO partition holds (DeepSpeed's lp -> hp mapping: where the parameter's slice starts in the
    parameter and in the flat fp32 partition), for DeepSpeed's ZeRO 1-2 optimizer and its bf16 ZeRO-1 one
    alike. The working (bf16 or fp32) parameters are then gathered from the masters (update_lp_params).

    DeepSpeed 0.19's own loader (load_hp_checkpoint_state_from_checkpoint_dir) cuts TP shards by the split
    patterns the checkpoint recorded (absent from a tp=1 checkpoint before 2026-11-28), reads the mp_rank files
    of a ZeRO 1-2 checkpoint (a ZeRO-3 one names them otherwise), keeps bf16 and fp32 states apart, and puts the
    saved groups' hyperparameters in place of this run's. This loader touches only the per-parameter states."""
    model, zero = engine.model, engine.optimizer
    lp_groups = getattr(zero, "bit16_groups", None) or zero.bf16_groups  # ZeRO 1-2's optimizer or the bf16 one
    slots = _slots_by_parameter(model)
    step_of = _universal_steps(zero_dir)
    # Every group's partition gets the step, also one holding no parameter's slice (a small group over many
    # ranks: its Adam would find moments without a step)
    step = _one_step({step_of(name) for name, _, _ in slots.values()})
    for group, params in zip(zero.optimizer.param_groups, lp_groups):
        master = group["params"][0]  # this rank's flat fp32 partition of the group
        flats = {key: torch.zeros_like(master) for key in ("fp32", "exp_avg", "exp_avg_sq")}
        for param in params:
            fragment = param._hp_mapping
            if fragment is None:  # wholly in other ranks' partitions
                continue
            at, to = fragment.lp_fragment_address, fragment.hp_fragment_address
            for key, flat in flats.items():
                part = _tp_share(zero_dir, model, slots[id(param)], key, param.shape)
                flat.narrow(0, to.start, to.numel).copy_(part.reshape(-1).narrow(0, at.start, at.numel))
        master.copy_(flats.pop("fp32"))
        state = zero.optimizer.state[master]
        for key, flat in flats.items():
            if key in state:  # in place: DeepSpeed's fragments (tensor_fragment.optim_fragment) view these
                state[key].copy_(flat)
            else:
                state[key] = flat
        state["step"] = _adam_step(zero.optimizer, master, step)
    zero.update_lp_params()


@torch.no_grad()
def _load_zero3_universal(engine, zero_dir: str) -> None:
    """A ZeRO-3 engine resuming a checkpoint of another DP or TP size, or of ZeRO 0-2: each parameter's fp32
    master, Adam moments and step, from the universal form's full tensors, cut first to this rank's TP share (as
    the model's build cuts them: model/init.local_part) and then to its ZeRO partition (DeepSpeed's: the flat
    TP-local tensor zero-padded to a multiple of the partition group's size, partition `rank` of it). The
    bf16/fp32 working partitions are then refreshed from the masters. A sub-group swapped to NVMe
    (zero.offload_optimizer=nvme) is swapped in to be filled and out again, as its optimizer step does.

    DeepSpeed 0.19's loader (load_hp_checkpoint_state_from_checkpoint_dir_stage3) partitions each full tensor as
    it is: right only when the checkpoint's TP size is this job's (it cuts TP shards for its AutoTP layers
    alone); it also reads the model-states files of a ZeRO-3 checkpoint, which a ZeRO 0-2 one names otherwise,
    and hands every group group 0's hyperparameters and one shared `step` tensor. This loader touches only the
    per-parameter states: the groups keep this run's hyperparameters, each sub-group its own step."""
    model, zero3 = engine.model, engine.optimizer
    slots = _slots_by_parameter(model)
    step_of, steps = _universal_steps(zero_dir), set()
    for sub_group, params in enumerate(zero3.fp16_groups):
        numel_of_group = zero3.fp16_partitioned_groups_flat_numel[sub_group]
        flats = {key: torch.zeros(numel_of_group) for key in ("fp32", "exp_avg", "exp_avg_sq")}
        offset = 0
        for param in params:
            group = zero3._get_param_partition_group(param)
            world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
            numel = param.ds_tensor.ds_numel  # this rank's partition: ceil(TP-local numel / world)
            for key, flat in flats.items():
                part = _tp_share(zero_dir, model, slots[id(param)], key, param.ds_shape)
                padded = torch.cat([part.reshape(-1), part.new_zeros(numel * world - part.numel())])
                flat.narrow(0, offset, numel).copy_(padded.narrow(0, rank * numel, numel))
            steps.add(step_of(slots[id(param)][0]))
            offset += numel
        assert offset == numel_of_group, f"sub-group {sub_group}: {offset} loaded elements for {numel_of_group}"
        _fill_zero3_sub_group(zero3, sub_group, flats, _one_step(steps))
    zero3.invalidate_secondary_tensor()  # hpZ's secondary shards hold the build's values: made again from these


@torch.no_grad()
def load_offloaded(engine, path: str, rank: int) -> None:
    """A job that swaps its optimizer to NVMe resuming a checkpoint written at its own layout by a job that did
    too: every sub-group from this rank's own files, no conversion: the in-memory ones from its optimizer file,
    the swapped ones from DeepSpeed's copy of its swap files (where offload_rank<r>.pt says). DeepSpeed 0.19's own
    load of it copies the swap files back but skips the optimizer file: the in-memory sub-groups kept their
    initial values and every step the build's (measured: the resumed losses 1.1 off)."""
    zero3 = engine.optimizer
    record = nvme_checkpoint.own(path, rank)
    optim = torch.load(os.path.join(path, record["optim_states"]), map_location="cpu", weights_only=False)
    optim = optim["optimizer_state_dict"]
    for sub_group in range(len(zero3.fp16_groups)):
        swapped = zero3._swappable_optimizer_subgroup(sub_group)
        assert swapped == (sub_group in record["swapped"]), f"sub-group {sub_group} swapped: {swapped} here"
        stored = optim["optimizer_state_dict"]["state"][sub_group]
        if swapped:
            flats = nvme_checkpoint.read_swapped(path, record, sub_group)
        else:
            flats = {
                "fp32": optim["fp32_flat_groups"][sub_group],
                **{key: stored[key] for key in ("exp_avg", "exp_avg_sq")},
            }
        _fill_zero3_sub_group(zero3, sub_group, flats, stored["step"])
    zero3.invalidate_secondary_tensor()  # (as after the universal load)


def _fill_zero3_sub_group(zero3, sub_group: int, flats: dict, step) -> None:
    """Put one sub-group's flat fp32 master and Adam moments (this rank's partition) and its step into ZeRO-3's
    optimizer, and its working partition (bf16 or fp32) from the master: copied and unflattened, or swapped out
    to NVMe with offload_param=nvme. A sub-group swapped to NVMe (zero.offload_optimizer=nvme) is swapped in to be
    filled and out again, as its optimizer step does."""
    swapped = zero3._swappable_optimizer_subgroup(sub_group)
    if swapped:
        zero3._optimizer_states_and_gradient_swap_in(sub_group)
    master = zero3.fp32_partitioned_groups_flat[sub_group]
    master.copy_(flats["fp32"])
    state = zero3.optimizer.state[master]
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:  # in place: the swapper writes back the tensors it holds
            state[key].copy_(flats[key])
        else:  # (a lazy optimizer has made none yet)
            state[key] = flats[key].to(master.device, copy=True)
    state["step"] = _adam_step(zero3.optimizer, master, step)
    zero3._reassign_or_swap_out_partitioned_parameters(sub_group)
    if swapped:
        zero3._optimizer_states_and_gradient_swap_out(sub_group)


def load_into(engine, zero_dir: str, zero_stage: int) -> None:
    """Collective only in that every rank calls it: load the universal form's `zero_dir` (path/universal/zero)
    into this rank's engine of ZeRO stage `zero_stage`."""
    loader = {0: _load_zero0_universal, 3: _load_zero3_universal}.get(zero_stage, _load_zero12_universal)
    loader(engine, zero_dir)
