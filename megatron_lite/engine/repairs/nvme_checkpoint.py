"""What a checkpoint of an optimizer swapped to NVMe (zero.offload_optimizer=nvme, ZeRO-3) holds, and reading it.

DeepSpeed 0.19 saves the optimizer sub-groups it swaps to NVMe empty in each rank's optimizer file (their fp32
masters and Adam moments live in its swap files) and copies its swap folder beside it: offloaded_tensors/rank<NN>/,
one raw file per tensor, named by the parameter ids of the sub-group (<ids>.tensor.swp, exp_avg-<ids>.tensor.swp,
...). Its own load copies the folder back but skips the optimizer file, and its converter cannot read such a
checkpoint. So each rank also records which sub-groups it swapped and where (`record`, saved as
offload_rank<r>.pt), and:
- the conversion (checkpoint/universal.py) puts their tensors back into a copy of each optimizer file
  (`with_states`): a checkpoint of an NVMe-swapped optimizer converts like any other;
- at the layout it was written with, into a job that swaps too, each rank fills its sub-groups from its own files
  (engine/repairs/universal_load.load_offloaded, reading them with `read_swapped`): no conversion.
A checkpoint written before the ranks recorded this (2026-11-29) is refused (`unrecorded`).
"""

from __future__ import annotations

import glob
import os

import torch

OFFLOADED = "offload_rank{rank:05d}.pt"


def swaps_optimizer(ds_engine) -> bool:
    return bool(ds_engine.zero_nvme_offload_optimizer())


def record(ds_engine, path: str, rank: int) -> tuple[str, dict] | None:
    """Where this rank's record goes in the checkpoint `path` just saved, and the record: the optimizer file its
    swapped states belong in, DeepSpeed's copy of its swap folder, and each swapped sub-group's parameter ids and
    length. None when the optimizer is not swapped to NVMe."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    if not swaps_optimizer(ds_engine):
        return None
    zero3 = ds_engine.optimizer
    swapped = {}
    for sub_group, master in enumerate(zero3.fp32_partitioned_groups_flat):
        if zero3._swappable_optimizer_subgroup(sub_group):
            assert master.dtype == torch.float32, f"sub-group {sub_group}: {master.dtype} masters"
            swapped[sub_group] = (master.ds_id, zero3.fp16_partitioned_groups_flat_numel[sub_group])
    return os.path.join(path, OFFLOADED.format(rank=rank)), {
        "optim_states": os.path.basename(ds_engine._get_zero_ckpt_name("", "")),
        "folder": os.path.join("offloaded_tensors", "rank" + dp_index_to_str(rank)),
        "swapped": swapped,
    }


def _files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(path), "offload_rank*.pt")))


def recorded(path: str) -> bool:
    """Whether checkpoint `path` was written by ranks that swapped their optimizer to NVMe (and recorded it)."""
    return bool(_files(path))


def unrecorded(path: str, meta: dict) -> bool:
    """Whether `path` is an NVMe checkpoint written before the ranks recorded where their swapped states went
    (2026-11-29): they are empty in its optimizer files, and DeepSpeed's own load of it is not exact."""
    nvme = meta["kind"] == "deepspeed" and meta["config"].get("zero", {}).get("offload_optimizer") == "nvme"
    return nvme and not recorded(path)


def by_file(path: str) -> dict[str, dict]:
    """Checkpoint `path`'s records by the optimizer file each completes ({} without NVMe)."""
    records = (torch.load(file, weights_only=True) for file in _files(path))
    return {record["optim_states"]: record for record in records}


def own(path: str, rank: int) -> dict:
    """This rank's record in checkpoint `path`."""
    return torch.load(os.path.join(path, OFFLOADED.format(rank=rank)), weights_only=True)


def read_swapped(path: str, record: dict, sub_group: int) -> dict[str, torch.Tensor]:
    """A swapped sub-group's fp32 master and Adam moments, from DeepSpeed's copy of its swap files in checkpoint
    `path` (raw fp32, padded to the I/O alignment: the first `numel` values are the tensor)."""
    ids, numel = record["swapped"][sub_group]
    out = {}
    for key, name in (("fp32", ids), ("exp_avg", f"exp_avg-{ids}"), ("exp_avg_sq", f"exp_avg_sq-{ids}")):
        file = os.path.join(path, record["folder"], f"{name}.tensor.swp")
        assert os.path.getsize(file) >= 4 * numel, f"{file}: {os.path.getsize(file)} bytes for {numel} values"
        out[key] = torch.from_file(file, shared=False, size=numel, dtype=torch.float32)
    return out


def with_states(path: str, record: dict, out: str) -> None:
    """Write to `out` the optimizer file record["optim_states"] of checkpoint `path` with its swapped sub-groups'
    fp32 masters and Adam moments read back from DeepSpeed's copy of the swap files."""
    saved = torch.load(os.path.join(path, record["optim_states"]), map_location="cpu", weights_only=False)
    optim = saved["optimizer_state_dict"]
    for sub_group in record["swapped"]:
        flats = read_swapped(path, record, sub_group)
        optim["fp32_flat_groups"][sub_group] = flats.pop("fp32")
        optim["optimizer_state_dict"]["state"][sub_group].update(flats)
    torch.save(saved, out)
