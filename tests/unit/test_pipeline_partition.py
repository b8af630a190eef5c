"""Layers -> virtual stages -> (pipeline rank, chunk): uniform and uneven splits, and every split we refuse."""

import re

import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.pipeline.partition import layers_per_stage, rank_chunks, stage_layers, stage_owner, virtual_stage


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (2, 3)])
def test_every_layer_lands_on_exactly_one_chunk(pp, vpp):
    n_layers = 2 * pp * vpp
    seen = []
    for r in range(pp):
        for spec in rank_chunks(r, pp, vpp, n_layers):
            assert spec.virtual_stage == virtual_stage(r, spec.chunk, pp) == spec.chunk * pp + r
            assert stage_owner(spec.virtual_stage, pp) == (r, spec.chunk)
            assert len(spec.layers) == 2
            assert spec.has_embedding == (spec.virtual_stage == 0)
            assert spec.has_head == (spec.virtual_stage == pp * vpp - 1)
            seen += list(spec.layers)
    assert sorted(seen) == list(range(n_layers))


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_v_shape_places_stages_down_and_back(pp):
    """zbv: rank r holds stages r and 2pp-1-r, so rank 0 holds the embedding and the head."""
    n_layers, seen = 4 * pp, []
    for r in range(pp):
        specs = rank_chunks(r, pp, 2, n_layers, v_shape=True)
        assert [s.virtual_stage for s in specs] == [r, 2 * pp - 1 - r]
        for spec in specs:
            assert stage_owner(spec.virtual_stage, pp, v_shape=True) == (r, spec.chunk)
            assert spec.layers == range(2 * spec.virtual_stage, 2 * spec.virtual_stage + 2)
            seen += list(spec.layers)
        assert [(s.has_embedding, s.has_head) for s in specs] == (
            [(True, False), (False, True)] if r == 0 else [(False, False)] * 2
        )
    assert sorted(seen) == list(range(n_layers))


def test_interleaved_chunks_are_not_contiguous():
    # pp=2, vpp=2, 8 layers: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert [s.layers for s in rank_chunks(0, 2, 2, 8)] == [range(0, 2), range(4, 6)]
    assert [s.layers for s in rank_chunks(1, 2, 2, 8)] == [range(2, 4), range(6, 8)]
    assert [(s.has_embedding, s.has_head) for s in rank_chunks(0, 2, 2, 8)] == [(True, False), (False, False)]
    assert [(s.has_embedding, s.has_head) for s in rank_chunks(1, 2, 2, 8)] == [(False, False), (False, True)]


def test_uneven_split_and_empty_ends():
    assert stage_layers(8, 2, 2, [1, 3, 3, 1]) == [range(0, 1), range(1, 4), range(4, 7), range(7, 8)]
    # the ends may hold no block at all: they still run the embedding / the head
    assert layers_per_stage(4, 2, 2, [0, 2, 2, 0]) == [0, 2, 2, 0]
    last = rank_chunks(1, 2, 2, 4, [0, 2, 2, 0])[1]
    assert last.has_head and len(last.layers) == 0
    # a Hydra ListConfig arrives as any sequence
    assert layers_per_stage(6, 3, 1, (1, 3, 2)) == [1, 3, 2]


# (n_layers, pp, vpp, pp_layers, text the one-line message must contain)
BAD = [
    (12, 4, 2, None, "parallel.vpp=2"),  # 8 virtual stages do not divide 12
    (6, 4, 1, None, "parallel.pp=4"),
    (5, 4, 2, None, "no split of 5 layers fills 8 virtual stages"),
    (4, 2, 2, [1, 1, 1], "parallel.pp_layers=[1,1,1] has 3 entries"),
    (4, 2, 2, [2, 2, 1, 0], "parallel.pp_layers=[2,2,1,0] sums to 5 but model.n_layers=4"),
    (4, 2, 2, [1, 0, 2, 1], "parallel.pp_layers=[1,0,2,1] leaves virtual stage 1 without layers"),
    (4, 2, 2, [-1, 2, 2, 1], "parallel.pp_layers=[-1,2,2,1] must hold integers >= 0"),
    (4, 2, 2, [1.5, 1, 1, 0.5], "parallel.pp_layers=[1.5,1,1,0.5] must hold integers"),
    (4, 0, 1, None, "parallel.pp=0 must be an integer >= 1"),
    (4, 2, 0, None, "parallel.vpp=0 must be an integer >= 1"),
]


@pytest.mark.parametrize("n_layers,pp,vpp,pp_layers,text", BAD)
def test_impossible_splits_explain_themselves(n_layers, pp, vpp, pp_layers, text):
    with pytest.raises(ConfigError) as info:
        layers_per_stage(n_layers, pp, vpp, pp_layers)
    msg = str(info.value)
    assert text in msg and "\n" not in msg
    # where the message proposes a pp_layers list, that list is accepted as is
    suggestion = re.search(r"e\.g\. parallel\.pp_layers=\[([0-9,]*)\]", msg)
    if suggestion:
        counts = [int(c) for c in suggestion.group(1).split(",")]
        assert layers_per_stage(n_layers, pp, vpp, counts) == counts


def test_uniform_error_lists_working_stage_counts():
    with pytest.raises(ConfigError, match=r"pick pp\*vpp among 1, 2, 3, 4, 6, 12") as info:
        layers_per_stage(12, 4, 2)
    assert "parallel.pp_layers=[1,2,2,2,2,1,1,1]" in str(info.value)  # spare layers go to the middle
