"""The universal form of a checkpoint, and loading it into an engine of any layout, ZeRO stage or precision.

When a checkpoint's number of ZeRO partitions (dp x cp), TP size, ZeRO stage, pipeline layout or state format
(bf16 or fp32) differs from the current job's (layout.Layout.needs_conversion), or one of the two swaps its
optimizer to NVMe and the other does not (below), rank 0 converts it once into
DeepSpeed's universal (layout-free) format beside the shards (path/universal): DeepSpeed's converter merges the
TP shards by the split patterns the engine saved with the checkpoint (model/layout.universal_split_patterns)
into one full fp32 tensor per parameter and state (a ZeRO-0 checkpoint, which has no ZeRO optimizer files,
through its merge step alone: _zero0_to_universal; an optimizer swapped to NVMe has its swapped states put
back from the swap files first: _with_offloaded_states). Every rank then loads that with our loader for its ZeRO
stage (load_into), which cuts each tensor to this rank's TP share as the model's build does and then to its
ZeRO partition as DeepSpeed lays it out. The same conversion gives checkpoint/weights.py the full weights of a
TP or pipeline run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import socket
import time
import zlib

import torch
import torch.distributed as dist

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.resume import warn
from megatron_lite.checkpoint.store import UNIVERSAL, read_meta


# --- the conversion -------------------------------------------------------------------------------------------

def universal_dir(path: str, scratch: str | None = None) -> str:
    """Where the universal form of checkpoint `path` goes: path/universal, or, when the step directory cannot be
    written (a read-only copy of a checkpoint), a directory of its own under `scratch` (the job's
    checkpoint.dir: a shared file system the job writes anyway)."""
    if scratch is None or os.access(path, os.W_OK):
        return os.path.join(path, UNIVERSAL)
    return os.path.join(scratch, f".{UNIVERSAL}_of_{os.path.basename(os.path.normpath(path))}_"
                                 f"{zlib.crc32(os.path.realpath(path).encode()):08x}")


def _universal_problem(target: str) -> str | None:
    """Why the universal form at `target` cannot be used as it is (None: every file matches the manifest its
    `done` file holds). A `done` without a manifest (written before 2026-11-28) cannot be checked."""
    try:
        with open(os.path.join(target, "done")) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return "not converted" if not os.path.exists(target) else "an unfinished conversion"
    except (OSError, ValueError):
        return "its conversion records no manifest to check it by"
    return store.verify_share(target, manifest, 0, 1)


def convert_to_universal(path: str, target: str | None = None) -> str:
    """Convert the checkpoint `path` into its universal form at `target` (default path/universal); one process,
    no groups. A finished conversion is used again once its files match its manifest (else it is made again,
    with a warning). Jobs converting the same checkpoint at once each write their own temporary directory and
    rename it into place; the first wins and the others use it. ZeRO 1-3 checkpoints go through DeepSpeed's
    converter whole (an NVMe-offloaded one's swapped states put back first: _with_offloaded_states), a ZeRO-0 one
    through its merge step (_zero0_to_universal)."""
    target = target or os.path.join(path, UNIVERSAL)
    problem = _universal_problem(target)
    if problem is None:
        return target
    if os.path.exists(target):
        warn(f"{target}: {problem}; converting {path} again")
        shutil.rmtree(target, ignore_errors=True)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    # Outside the step directory, and reading it through a view of its own files: DeepSpeed's converter walks its
    # input directory, and would count the files of a conversion that another job finished meanwhile.
    parent = os.path.dirname(target)
    if os.path.realpath(parent) == os.path.realpath(path):
        parent = os.path.dirname(os.path.normpath(path))
    prefix = os.path.join(parent, f".{os.path.basename(os.path.normpath(path))}_{UNIVERSAL}.tmp.")
    _remove_killed_conversions(prefix)
    tmp = f"{prefix}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    view = tmp + ".input"
    os.makedirs(view)
    try:
        offloaded = offloaded_by_file(path)
        for name in os.listdir(path):
            if name in offloaded:
                _with_offloaded_states(path, offloaded[name], os.path.join(view, name))
            elif os.path.isfile(os.path.join(path, name)):
                os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(view, name))
        meta = read_meta(path)
        if meta["layout"]["zero_stage"] == 0:
            _zero0_to_universal(path, meta, tmp)
        else:
            ds_to_universal(argparse.Namespace(
                input_folder=view, output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
                keep_temp_folder=False, strict=True, inject_missing_state=False,
            ))
        manifest = store.manifest_share(tmp, 0, 1)  # before `done` exists: it is not among its own files
        with open(os.path.join(tmp, "done"), "w") as f:
            json.dump(manifest, f)
        store.fsync_tree(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another job's conversion got there first
            if _universal_problem(target) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(view, ignore_errors=True)
    return target


# NVMe optimizer offload (zero.offload_optimizer=nvme, ZeRO-3). DeepSpeed 0.19 saves the optimizer sub-groups it
# swaps to NVMe empty in each rank's optimizer file (their fp32 masters and Adam moments live in its swap files) and
# copies its swap folder beside it: offloaded_tensors/rank<NN>/, one raw file per tensor, named by the parameter ids
# of the sub-group (<ids>.tensor.swp, exp_avg-<ids>.tensor.swp, ...). So each rank also records which sub-groups
# it swapped and where (offloaded_states, saved as offload_rank<r>.pt), and the conversion puts their tensors back
# into a copy of the optimizer file (_with_offloaded_states): a checkpoint of an NVMe-swapped optimizer converts like
# any other, and our ZeRO-3 loader swaps each sub-group of an NVMe-swapped job in to fill it and out again. At the
# layout it was written with, into a job that swaps too, each rank fills its sub-groups from its own files
# (load_offloaded): no conversion.

OFFLOADED = "offload_rank{rank:05d}.pt"


def offloaded_states(engine, rank: int) -> dict | None:
    """What the conversion needs to find this rank's swapped optimizer states in the checkpoint just saved: the
    optimizer file they belong in, DeepSpeed's copy of the swap folder, and each swapped sub-group's parameter
    ids and length. None when the optimizer is not swapped to NVMe."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    if not swaps_optimizer(engine):
        return None
    zero3 = engine.optimizer
    swapped = {}
    for sub_group, master in enumerate(zero3.fp32_partitioned_groups_flat):
        if zero3._swappable_optimizer_subgroup(sub_group):
            assert master.dtype == torch.float32, f"sub-group {sub_group}: {master.dtype} masters"
            swapped[sub_group] = (master.ds_id, zero3.fp16_partitioned_groups_flat_numel[sub_group])
    return {"optim_states": os.path.basename(engine.ds_engine._get_zero_ckpt_name("", "")),
            "folder": os.path.join("offloaded_tensors", "rank" + dp_index_to_str(rank)), "swapped": swapped}


def swaps_optimizer(engine) -> bool:
    return bool(engine.ds_engine.zero_nvme_offload_optimizer())


def offloaded_by_file(path: str) -> dict[str, dict]:
    """The checkpoint's offloaded_states records by the optimizer file each completes ({} without NVMe)."""
    records = (torch.load(os.path.join(path, name), weights_only=True) for name in sorted(os.listdir(path))
               if name.startswith("offload_rank") and name.endswith(".pt"))
    return {record["optim_states"]: record for record in records}


def _read_offloaded(path: str, record: dict, sub_group: int) -> dict[str, torch.Tensor]:
    """A swapped sub-group's fp32 master and Adam moments, from DeepSpeed's copy of its swap files in checkpoint
    `path` (raw fp32, padded to the I/O alignment: the first `numel` values are the tensor)."""
    ids, numel = record["swapped"][sub_group]
    out = {}
    for key, name in (("fp32", ids), ("exp_avg", f"exp_avg-{ids}"), ("exp_avg_sq", f"exp_avg_sq-{ids}")):
        file = os.path.join(path, record["folder"], f"{name}.tensor.swp")
        assert os.path.getsize(file) >= 4 * numel, f"{file}: {os.path.getsize(file)} bytes for {numel} values"
        out[key] = torch.from_file(file, shared=False, size=numel, dtype=torch.float32)
    return out


def _with_offloaded_states(path: str, record: dict, out: str) -> None:
    """Write to `out` the optimizer file record["optim_states"] of checkpoint `path` with its swapped sub-groups'
    fp32 masters and Adam moments read back from DeepSpeed's copy of the swap files."""
    saved = torch.load(os.path.join(path, record["optim_states"]), map_location="cpu", weights_only=False)
    optim = saved["optimizer_state_dict"]
    for sub_group in record["swapped"]:
        flats = _read_offloaded(path, record, sub_group)
        optim["fp32_flat_groups"][sub_group] = flats.pop("fp32")
        optim["optimizer_state_dict"]["state"][sub_group].update(flats)
    torch.save(saved, out)


def _remove_killed_conversions(prefix: str) -> None:
    """Remove what conversions of this checkpoint killed part-way on this host left (<prefix><host>.<pid>.<hex>
    and its .input view: only the converting process's `finally` removes them), once their process is gone. An
    NVMe checkpoint's view holds real copies of its optimizer files (_with_offloaded_states): a kill left all
    its optimizer states behind. Another host's are left alone: its pid means nothing here."""
    folder, start = os.path.split(prefix)
    host = socket.gethostname()
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        owner = name[len(start):].split(".")
        if not name.startswith(start) or len(owner) < 3 or owner[0] != host or not owner[1].isdigit():
            continue
        if not os.path.exists(f"/proc/{owner[1]}"):
            warn(f"removing {os.path.join(folder, name)}, left by a conversion that was killed")
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _zero0_to_universal(path: str, meta: dict, out: str) -> None:
    """The universal form (out/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt) of a ZeRO-0 checkpoint.

    DeepSpeed's converter reads ZeRO's optimizer files, which ZeRO-0 does not write: each pipeline x TP rank's
    mp_rank file holds its whole fp32 parameters and torch AdamW's state instead. So those are laid out as the
    converter's extracted fragments (one per TP rank, a single "dp" fragment each), and its merge step joins
    the TP slices by the split patterns saved in the checkpoint, as for ZeRO 1-3. Names are global, so the
    pipeline stages are a union; the last stage's copy of a tied embedding equals the first stage's and is
    left out. Our loaders read nothing else (DeepSpeed's, which also read each mp_rank file's bookkeeping and the
    optimizer's group settings, are not used)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    tp, pp = meta["layout"].get("tp", 1), meta["layout"].get("pp", 1)
    fragments, zero = os.path.join(out, "tmp"), os.path.join(out, "zero")
    os.makedirs(out)
    shapes: dict[str, list] = {}  # name -> its shape on each TP rank
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            name = f"mp_rank_{pp_rank * tp + tp_rank:02d}_model_states.pt"
            saved = torch.load(os.path.join(path, name), map_location="cpu", weights_only=False)
            for param, states in _zero0_states(saved).items():
                if len(shapes.setdefault(param, [])) > tp_rank:  # taken from an earlier stage (tied embedding)
                    continue
                shapes[param].append(states["fp32"].shape)
                folder = os.path.join(fragments, param, str(tp_rank))
                os.makedirs(folder, exist_ok=True)
                for key, value in states.items():
                    torch.save(value.reshape(-1) if key != "step" else value, os.path.join(folder, f"{key}.00"))
    for param, per_tp in shapes.items():
        merge_tp_slices(saved.get(UNIVERSAL_CHECKPOINT_INFO, {}), zero, fragments, tp, (param, per_tp))
    shutil.rmtree(fragments)


def _zero0_states(saved: dict) -> dict[str, dict]:
    """name -> {fp32, exp_avg, exp_avg_sq, step} of one ZeRO-0 mp_rank file: its module and torch AdamW's
    state, which is indexed by position: matrices, then vectors, each in the module's order
    (engine/ds_config.param_groups), checked against every state's shape."""
    from megatron_lite.engine.ds_config import decays

    buffers = set(saved.get("buffer_names") or ())
    params = {k: v for k, v in saved["module"].items() if k not in buffers}
    order = [k for k, v in params.items() if decays(v.shape)] + [k for k, v in params.items() if not decays(v.shape)]
    optimizer = saved["optimizer"]
    indices = [i for group in optimizer["param_groups"] for i in group["params"]]
    assert len(indices) == len(order), f"{len(indices)} optimizer entries for {len(order)} parameters"
    out = {}
    for index, name in zip(indices, order):
        state = optimizer["state"][index]
        assert state["exp_avg"].shape == params[name].shape, f"optimizer entry {index} is not {name}"
        out[name] = {"fp32": params[name].float(), "exp_avg": state["exp_avg"].float(),
                     "exp_avg_sq": state["exp_avg_sq"].float(), "step": state["step"]}
    return out


def prepare_universal(path: str, ctx, scratch: str | None = None) -> str:
    """Rank 0 converts `path` to the universal format (or checks an earlier conversion); the others wait for
    its word on disk, not in a collective: converting a large checkpoint can outlast any collective timeout
    (dist.timeout_s). The word is a file named by a token of this job's, so a conversion that an earlier job
    left (and rank 0 may find damaged and make again) is not taken for it. Should rank 0 die meanwhile,
    torchrun (or srun) ends the others. Returns where the universal form is (universal_dir)."""
    token = [secrets.token_hex(8) if ctx.is_rank0 else None]
    dist.broadcast_object_list(token, src=0)
    target = universal_dir(path, scratch)
    ready = os.path.join(target, f"ready.{token[0]}")
    if ctx.is_rank0:
        convert_to_universal(path, target)
        open(ready, "w").close()
    else:
        while not os.path.isfile(ready):
            time.sleep(0.5)
    dist.barrier()
    if ctx.is_rank0:
        os.remove(ready)
    return target


# --- loading it ------------------------------------------------------------------------------------------------

def universal_tensor(zero_dir: str, name: str, state: str, vocab_rows: int, width: int | None = None) -> torch.Tensor:
    """One full fp32 tensor of the universal form (state: fp32, exp_avg or exp_avg_sq), a vocabulary tensor's
    rows brought to `vocab_rows` (the conversion drops a TP checkpoint's padding rows; padded rows are zero).
    DeepSpeed's merge of a ZeRO-3 checkpoint at tp 1 saves each tensor bare and flat: `width`, the parameter's
    last dim when it has two, gives it its rows back."""
    saved = torch.load(os.path.join(zero_dir, name, f"{state}.pt"), map_location="cpu", weights_only=False)
    tensor = saved["param"] if isinstance(saved, dict) else saved
    if tensor.dim() == 1 and width is not None:
        tensor = tensor.view(-1, width)
    return with_vocab_rows(name, tensor.float(), vocab_rows)


def _rows_and_width(shape: tuple) -> tuple[int, int | None]:
    """universal_tensor's vocab_rows and width for a parameter of the whole model's `shape`."""
    return shape[0], shape[1] if len(shape) == 2 else None


def with_vocab_rows(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary tensor (the embedding, the head) with `rows` rows: padding rows cut, or zero rows added (the
    padding depends on tp: model.vocab_multiple x tp); any other tensor as it is."""
    if name not in ("wte.weight", "lm_head.weight") or tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros(max(0, rows - tensor.shape[0]), tensor.shape[1])
    return torch.cat([tensor[:rows], padding])


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
    part = local_part(module, attr, universal_tensor(zero_dir, name, key, *_rows_and_width(model.full_shapes[name])))
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
            **{key: _tp_share(zero_dir, model, slot, key, param.shape).clone() for key in ("exp_avg", "exp_avg_sq")}}
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


@torch.no_grad()
def load_offloaded(engine, path: str, rank: int) -> None:
    """A job that swaps its optimizer to NVMe resuming a checkpoint written at its own layout by a job that did
    too: every sub-group from this rank's own files, no conversion: the in-memory ones from its optimizer file,
    the swapped ones from DeepSpeed's copy of its swap files (where offload_rank<r>.pt says). DeepSpeed 0.19's own
    load of it copies the swap files back but skips the optimizer file: the in-memory sub-groups kept their
    initial values and every step the build's (measured: the resumed losses 1.1 off)."""
    zero3 = engine.optimizer
    record = torch.load(os.path.join(path, OFFLOADED.format(rank=rank)), weights_only=True)
    optim = torch.load(os.path.join(path, record["optim_states"]), map_location="cpu", weights_only=False)
    optim = optim["optimizer_state_dict"]
    for sub_group in range(len(zero3.fp16_groups)):
        swapped = zero3._swappable_optimizer_subgroup(sub_group)
        assert swapped == (sub_group in record["swapped"]), f"sub-group {sub_group} swapped: {swapped} here"
        stored = optim["optimizer_state_dict"]["state"][sub_group]
        if swapped:
            flats = _read_offloaded(path, record, sub_group)
        else:
            flats = {"fp32": optim["fp32_flat_groups"][sub_group],
                     **{key: stored[key] for key in ("exp_avg", "exp_avg_sq")}}
        _fill_zero3_sub_group(zero3, sub_group, flats, stored["step"])


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
