"""Which resumes go through DeepSpeed's universal format: a layout change does, the same layout never does."""

from megatron_lite.checkpoint import needs_universal, saved_pipeline


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
