"""Which resumes go through DeepSpeed's universal format (a layout change does, the same layout never does),
which precision changes a resume refuses, when RNG streams continue, and how a data-stream change is named."""

import json
from types import SimpleNamespace

import pytest

from megatron_lite.checkpoint.resume import data_stream_changes, needs_universal, same_layout, saved_pipeline
from megatron_lite.cli import load
from megatron_lite.errors import ConfigError


def meta(**layout):
    base = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "vpp": 1, "zero_stage": 3, "layers_per_stage": [4]}
    return {"kind": "deepspeed", "layout": {**base, **layout}}


def test_same_layout_loads_directly():
    # meta.json records layers_per_stage even at pp=1; that must not read as a pipeline change
    assert saved_pipeline(meta()["layout"]) == (1, 1, ())
    assert not needs_universal(meta(), 2, 1, 3, (1, 1, ()))
    assert not needs_universal(meta(pp=2, layers_per_stage=[2, 2]), 2, 1, 3, (2, 1, (2, 2)))


def test_layout_changes_convert():
    assert needs_universal(meta(), 1, 1, 3, (1, 1, ()))                                # dp
    assert needs_universal(meta(pp=2, layers_per_stage=[2, 2]), 2, 1, 3, (1, 1, ()))  # pp
    assert needs_universal(meta(pp=2, layers_per_stage=[2, 2]), 2, 1, 3, (2, 1, (1, 3)))  # layer split
    assert not needs_universal(meta(zero_stage=0, pp=2, layers_per_stage=[2, 2]), 2, 1, 0, (1, 1, ()))  # ZeRO-0: never
    # ZeRO partitions over dp x cp (parameters are replicated over cp): their number is what matters
    assert needs_universal(meta(), 2, 1, 3, (1, 1, ()), cp_size=2)                     # dp 2 -> dp 2 x cp 2
    assert not needs_universal(meta(), 1, 1, 3, (1, 1, ()), cp_size=2)                 # dp 2 -> dp 1 x cp 2
    assert needs_universal(meta(dp=1, cp=2), 1, 1, 3, (1, 1, ()))                      # dp 1 x cp 2 -> dp 1


def test_resume_in_another_precision_is_refused_where_the_format_differs(tmp_path):
    """bf16 on ZeRO 1-3 writes DeepSpeed's bf16 states; fp32, and bf16 on ZeRO-0 (autocast), write fp32 ones."""
    def resume(saved_precision: str, saved_stage: int, *overrides: str):
        ckpt = tmp_path / f"{saved_precision}_{saved_stage}"
        ckpt.mkdir(exist_ok=True)
        cfg = load(["train.precision=fp32"], world_size=1)
        layout = {**meta(zero_stage=saved_stage, dp=1, world_size=1)["layout"], "precision": saved_precision}
        (ckpt / "meta.json").write_text(json.dumps({"kind": "deepspeed", "config": {"model": vars(cfg.model)},
                                                    "layout": layout}))
        return load([f"checkpoint.resume={ckpt}", *overrides], world_size=1)

    resume("bf16", 1, "train.precision=bf16", "zero.stage=2")  # same format
    resume("bf16", 0, "train.precision=fp32", "zero.stage=0")  # ZeRO-0 bf16 keeps fp32 parameters
    with pytest.raises(ConfigError, match=r"train.precision=fp32 .* use train.precision=bf16"):
        resume("bf16", 1, "train.precision=fp32", "zero.stage=1")
    with pytest.raises(ConfigError, match=r"train.precision=bf16 .* use train.precision=fp32"):
        resume("fp32", 2, "train.precision=bf16", "zero.stage=2")


def test_rng_streams_continue_only_at_the_same_layout():
    layout = {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "vpp": 1, "zero_stage": 2, "layers_per_stage": [4]}
    ctx = SimpleNamespace(world_size=4, dp_size=2, tp_size=2, cp_size=1)
    assert same_layout(layout, ctx, 2, (1, 1, ()))
    assert not same_layout(layout, SimpleNamespace(world_size=4, dp_size=1, tp_size=4, cp_size=1), 2, (1, 1, ()))
    assert not same_layout(layout, SimpleNamespace(world_size=4, dp_size=1, tp_size=2, cp_size=2), 2, (1, 1, ()))
    assert not same_layout(layout, ctx, 1, (1, 1, ()))


def test_data_stream_changes_are_named_by_key():
    cfg = load(["train.global_batch_size=32", "seed=7"], world_size=1)
    saved = {"seed": 1234, "data": {"path": cfg.data.path}, "train": {"global_batch_size": 16}}
    assert data_stream_changes(saved, cfg) == ["seed: 1234 -> 7", "train.global_batch_size: 16 -> 32"]
    assert data_stream_changes({"seed": 7, "data": {"path": cfg.data.path}, "train": {"global_batch_size": 32}},
                               cfg) == []
