"""DeepSpeed's checkpoint formats, as checkpoint/ uses them: a staging checkpoint engine for async saves, the
converter into the universal form (and our ZeRO-0 route into it), reading its tensors, and the full fp32 weights
of a ZeRO checkpoint. checkpoint/ owns the files, commits and choices; what DeepSpeed writes and reads is here.

The universal form is DeepSpeed's: <out>/zero/<parameter name>/{fp32,exp_avg,exp_avg_sq,step}.pt, each a full
tensor whatever the layout it was written at. Our loaders of it into an engine are engine/repairs/universal_load.py.

DeepSpeed is imported only inside the functions that use it: it logs to stdout from its import on, and the tools
that read a checkpoint's weights (generate.py) print their output there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
from collections.abc import Callable

import torch

from megatron_lite.engine.ds_config import decays


def staging_engine(copy: Callable[[object], object]):
    """A DeepSpeed checkpoint engine that stages instead of writing: its `save` keeps (path, copy(state)) in its
    `staged` list, where copy takes the state to host memory (checkpoint/writer.to_host)."""
    return _staging_class()(copy)


@functools.cache
def _staging_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class StagingEngine(TorchCheckpointEngine):
        def __init__(self, copy: Callable[[object], object]):
            super().__init__(config_params=None)
            self.staged: list[tuple[str, object]] = []
            self.copy = copy

        def save(self, state_dict, path: str):
            self.staged.append((path, self.copy(state_dict)))

        def preserves_storage_sharing(self):
            return False  # the copy holds each tensor compactly: DeepSpeed need not clone them on the device first

    return StagingEngine


def zero_to_universal(folder: str, out: str) -> None:
    """DeepSpeed's converter of a ZeRO 1-3 checkpoint `folder` into the universal form at `out`."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    ds_to_universal(
        argparse.Namespace(
            input_folder=folder,
            output_folder=out,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )


def zero_fp32_weights(path: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the ZeRO 1-3 checkpoint in step directory `path` (DeepSpeed's zero_to_fp32)."""
    if "deepspeed" not in sys.modules:  # its import-time log goes to stderr (the module docstring says why)
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(path), tag=os.path.basename(path))


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


def rows_and_width(shape: tuple) -> tuple[int, int | None]:
    """universal_tensor's vocab_rows and width for a parameter of the whole model's `shape`."""
    return shape[0], shape[1] if len(shape) == 2 else None


def with_vocab_rows(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary tensor (the embedding, the head) with `rows` rows: padding rows cut, or zero rows added (the
    padding depends on tp: model.vocab_multiple x tp); any other tensor as it is."""
    if name not in ("wte.weight", "lm_head.weight") or tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros(max(0, rows - tensor.shape[0]), tensor.shape[1])
    return torch.cat([tensor[:rows], padding])


def zero0_to_universal(path: str, meta: dict, out: str) -> None:
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
        out[name] = {
            "fp32": params[name].float(),
            "exp_avg": state["exp_avg"].float(),
            "exp_avg_sq": state["exp_avg_sq"].float(),
            "step": state["step"],
        }
    return out
