"""RNG streams in a checkpoint are read without pickle (issue 23): rank files with torch.load(weights_only=True),
rank 0's copy in meta.json as JSON; a pickled file from someone else is never unpickled."""

import json
import os
import pickle
import random

import numpy as np
import torch

from megatron_lite.checkpoint.sharded import load_rng, rng_from_json, rng_state, rng_to_json


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_streams_round_trip_through_the_file_and_through_json(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    state = rng_state()
    torch.save(state, tmp_path / "rng_rank00000.pt")
    meta = json.loads(json.dumps({"rng_rank0": rng_to_json(state)}))  # as meta.json holds it
    expected = _draws()
    for own in (True, False):  # the rank's own file, then rank 0's copy in meta.json
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        load_rng(str(tmp_path / "rng_rank00000.pt"), meta, own_streams=own)
        assert _draws() == expected
    assert rng_from_json(meta["rng_rank0"])["torch"].dtype == torch.uint8


class _Payload:
    def __reduce__(self):
        return (open, (os.environ["MARKER"], "w"))


def test_a_pickled_file_is_never_unpickled(tmp_path, monkeypatch, capsys):
    """An older (or hostile) rng file whose unpickling would create a file: load_rng reads it with
    weights_only=True, which refuses it, and falls back to meta.json; with no JSON copy either, it warns."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("MARKER", str(marker))
    with open(tmp_path / "rng_rank00000.pt", "wb") as f:
        pickle.dump({"python": _Payload()}, f)
    load_rng(str(tmp_path / "rng_rank00000.pt"), {"rng_rank0": "gASV...old base64 pickle"}, own_streams=True)
    assert not marker.exists()
    assert "not restored" in capsys.readouterr().out
