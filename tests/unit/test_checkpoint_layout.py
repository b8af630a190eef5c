"""Which resumes go through DeepSpeed's universal format (a layout change does, the same layout never does; so
does a change of the state format a precision gives), when RNG streams continue, and how a data-stream change
is named."""

import dataclasses
import json

from megatron_lite.checkpoint.resume import data_stream_changes
from megatron_lite.cli import load
from megatron_lite.layout import Layout


def meta(**layout):
    base = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "vpp": 1, "zero_stage": 3, "layers_per_stage": [4]}
    return {"kind": "deepspeed", "layout": {**base, **layout}}


def saved(**layout) -> Layout:
    return Layout.of_checkpoint(meta(**layout))


def run(dp: int, zero_stage: int, pipeline: tuple = (1, 1, ()), tp: int = 1, cp: int = 1) -> Layout:
    """This job's layout: dp x tp x cp x pp ranks, pipeline (pp, vpp, layers per virtual stage)."""
    pp, vpp, layers = pipeline
    return Layout(
        dp=dp,
        tp=tp,
        cp=cp,
        pp=pp,
        vpp=vpp,
        zero_stage=zero_stage,
        layers_per_stage=layers or (4,),
    )


def test_same_layout_loads_directly():
    # meta.json records layers_per_stage even at pp=1; that must not read as a pipeline change
    assert saved().pipeline == (1, 1, ())
    assert not run(2, 3).needs_conversion(saved())
    assert not run(2, 3, (2, 1, (2, 2))).needs_conversion(saved(pp=2, layers_per_stage=[2, 2]))


def test_layout_changes_convert():
    assert run(1, 3).needs_conversion(saved())  # dp
    assert run(2, 3).needs_conversion(saved(pp=2, layers_per_stage=[2, 2]))  # pp
    assert run(2, 3, (2, 1, (1, 3))).needs_conversion(saved(pp=2, layers_per_stage=[2, 2]))  # layer split
    # ZeRO-0 holds its whole optimizer state on every DP rank: only a TP or pipeline change converts
    assert not run(1, 0).needs_conversion(saved(zero_stage=0))  # dp
    assert run(2, 0).needs_conversion(saved(zero_stage=0, pp=2, layers_per_stage=[2, 2]))  # pp
    assert run(1, 0, tp=2).needs_conversion(saved(zero_stage=0))  # tp
    # ZeRO partitions over dp x cp (parameters are replicated over cp): their number is what matters
    assert run(2, 3, cp=2).needs_conversion(saved())  # dp 2 -> dp 2 x cp 2
    assert not run(1, 3, cp=2).needs_conversion(saved())  # dp 2 -> dp 1 x cp 2
    # zbv holds stages r and 2pp-1-r on rank r where interleaving holds r and pp+r: other shards per rank
    loop = saved(pp=2, vpp=2, layers_per_stage=[1, 1, 1, 1])
    v = dataclasses.replace(loop, schedule="zbv")
    assert v.needs_conversion(loop) and loop.needs_conversion(v) and not v.same_as(loop)
    assert Layout.of_checkpoint({"layout": v.to_meta()}) == v and not v.needs_conversion(v)
    older = saved(pp=2, vpp=2, layers_per_stage=[1, 1, 1, 1], v_shape=True)  # recorded the V, not the schedule
    assert older.v_shape and older.same_as(v) and not v.needs_conversion(older)
    assert run(1, 3).needs_conversion(saved(dp=1, cp=2))  # dp 1 x cp 2 -> dp 1


def test_layout_round_trips_through_meta_and_owns_the_accumulation():
    cfg = load(
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            "model.n_layers=8",
        ],
        world_size=4,
    )
    here = Layout.of_run(cfg, 4)
    assert (here.dp, here.pp, here.vpp, here.layers_per_stage, here.accumulation) == (2, 2, 2, (2, 2, 2, 2), 4)
    # resolved: parallel.schedule and train.precision were auto
    assert (here.schedule, here.precision) == ("interleaved", "fp32")
    back = Layout.of_checkpoint(
        {"layout": here.to_meta(), "config": {"train": {"global_batch_size": 16, "micro_batch_size": 2}}}
    )
    assert back == here and here.same_as(back) and not here.needs_conversion(back)


def test_resume_in_another_precision_converts_where_the_format_differs(tmp_path):
    """bf16 on ZeRO 1-3 writes DeepSpeed's bf16 states; fp32, and bf16 on ZeRO-0 (autocast), write fp32 ones.
    A resume in the other format goes through the universal form (our loaders read full fp32 tensors)."""

    def resume(saved_precision: str, saved_stage: int, *overrides: str):
        ckpt = tmp_path / f"{saved_precision}_{saved_stage}"
        ckpt.mkdir(exist_ok=True)
        cfg = load(["train.precision=fp32"], world_size=1)
        layout = {**meta(zero_stage=saved_stage, dp=1, world_size=1)["layout"], "precision": saved_precision}
        (ckpt / "meta.json").write_text(
            json.dumps({"kind": "deepspeed", "config": {"model": vars(cfg.model)}, "layout": layout})
        )
        return load([f"checkpoint.resume={ckpt}", *overrides], world_size=1)

    resume("bf16", 1, "train.precision=bf16", "zero.stage=2")  # same format
    resume("bf16", 0, "train.precision=fp32", "zero.stage=0")  # ZeRO-0 bf16 keeps fp32 parameters
    resume("bf16", 1, "train.precision=fp32", "zero.stage=1")  # converts
    resume("fp32", 2, "train.precision=bf16", "zero.stage=2")

    def at(precision: str | None, zero_stage: int) -> Layout:
        return Layout(dp=2, zero_stage=zero_stage, precision=precision, layers_per_stage=(4,))

    for stage in (1, 2, 3):
        assert at("bf16", stage).needs_conversion(at("fp32", stage)), stage
        assert at("fp32", stage).needs_conversion(at("bf16", stage)), stage
        assert not at("bf16", stage).needs_conversion(at("bf16", stage)), stage
        assert not at("bf16", stage).needs_conversion(at(None, stage)), stage  # older checkpoints: as before
    assert not at("bf16", 0).needs_conversion(at("fp32", 0))  # ZeRO-0 holds fp32 in either precision


def test_rng_streams_continue_only_at_the_same_layout():
    written = Layout.of_checkpoint(
        {"layout": {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "vpp": 1, "zero_stage": 2, "layers_per_stage": [4]}}
    )
    assert run(2, 2, tp=2).same_as(written)
    assert not run(1, 2, tp=4).same_as(written)
    assert not run(1, 2, tp=2, cp=2).same_as(written)
    assert not run(2, 1, tp=2).same_as(written)


def test_data_stream_changes_are_named_by_key():
    cfg = load(["train.global_batch_size=32", "seed=7"], world_size=1)
    saved = {"seed": 1234, "data": {"path": cfg.data.path}, "train": {"global_batch_size": 16}}
    assert data_stream_changes(saved, cfg) == ["seed: 1234 -> 7", "train.global_batch_size: 16 -> 32"]
    assert (
        data_stream_changes({"seed": 7, "data": {"path": cfg.data.path}, "train": {"global_batch_size": 32}}, cfg) == []
    )
