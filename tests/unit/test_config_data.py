"""Bad data configuration fails before any process group exists, with one line naming the directory, what is wrong
with it and the fix; and the forms a good one takes (one directory or a weighted blend, documents from eos)."""

import pytest

from megatron_lite.cli import load
from megatron_lite.errors import ConfigError
from tests.unit.test_config import _isolated_cwd, prepared  # noqa: F401 (_isolated_cwd: an autouse fixture)

BAD_DATA = [  # (data.path entries as prepared(...) arguments, further overrides, the message's start)
    (
        [{}, {"tokenizer": "assets/tokenizers/gpt2", "vocab": 50257}],
        [],
        r"^data.path\[1\]=\S+/d1 was prepared with tokenizer assets/tokenizers/gpt2 \(50257 tokens\), data.path\[0\]=",
    ),
    ([{}, {}], ["data.weights=[1.0]"], r"^data.weights=\[1.0\] has 1 entries for 2 data.path directories"),
    ([{}, {}], ["data.weights=[1.0,0.0]"], r"^data.weights=\[1.0, 0.0\] must all be positive"),
    ([{}, {}], ["data.weights=[1.0,-2.0]"], r"^data.weights=\[1.0, -2.0\] must all be positive"),
    ([{}, {}], ["data.weights=[1.0,0.00001]"], r"^data.weights=\[1.0, 1e-05\] gives a dataset 1e-05 of the blend"),
    (
        [{}, {"train": 100}],
        [],
        r"^data.path\[1\]=\S+/d1 has 100 train tokens, too few for one sample of "
        r"model.seq_len \+ 1 = 129; use more data",
    ),
    ([{"val": 0}], [], r"^data.path=\S+/d0 has 0 val tokens, too few .*train.eval_interval=0"),
    (
        [{"held": {"val": None}}],
        ["train.eval_interval=0"],  # val.bin is mapped even when nothing evaluates
        r"^data.path=\S+/d0 has no val.bin where its meta.json records 10000; prepare it again",
    ),
    (
        [{"eos": None}],
        ["data.document_mask=true"],
        r"^data.path=\S+/d0 has no train.idx.npy and no eos_id in its meta.json, so data.document_mask=true "
        r"cannot tell where its documents begin; prepare it again with tools/prepare_data.py",
    ),
    (
        [{}, {"held": {"train": 99_999}}],
        [],
        r"^data.path\[1\]=\S+/d1 has 99999 tokens in train.bin where its meta.json records 100000; prepare it again",
    ),
]


@pytest.mark.parametrize("dirs,overrides,expected", BAD_DATA, ids=[" ".join(b[1]) or b[2][:30] for b in BAD_DATA])
def test_bad_data_gives_one_line(dirs, overrides, expected, tmp_path):
    paths = [prepared(tmp_path / f"d{k}", **d) for k, d in enumerate(dirs)]
    path = paths[0] if len(paths) == 1 else "[" + ",".join(paths) + "]"
    with pytest.raises(ConfigError, match=expected) as err:
        load([f"data.path={path}", *overrides], world_size=1)
    assert "\n" not in str(err.value) and ";" in str(err.value)


def test_document_mask_takes_boundaries_from_eos_without_an_index(tmp_path):
    """Data without a document index (prepared before it was written) still works by its eos id."""
    cfg = load([f"data.path={prepared(tmp_path / 'd')}", "data.document_mask=true"], world_size=1)
    assert cfg.data.document_mask


def test_a_blend_names_each_directory_once_and_composes(tmp_path):
    a, b = prepared(tmp_path / "a"), prepared(tmp_path / "b")
    with pytest.raises(ConfigError, match=r"^data.path=\[.*\] names a directory twice"):
        load([f"data.path=[{a},{b},{a}/]"], world_size=1)
    cfg = load([f"data.path=[{a},{b}]", "data.weights=[3,1]"], world_size=1)
    assert cfg.data.path == [a, b] and cfg.data.weights == [3.0, 1.0]
    assert load([f"data.path={a}"], world_size=1).data.path == a  # one directory stays a string
    assert load([f"data.path={a}", "train.eval_interval=0"], world_size=1).data.weights is None
