"""The learning-rate schedule (warmup, then cosine / linear / constant to min_lr at train.steps) and what a resume
that changes its settings is told."""

import math

import pytest

from megatron_lite.cli import load
from megatron_lite.lr_schedule import lr_at, schedule_change


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def cfg(*overrides):
    return load(
        ["train.steps=100", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10", *overrides], world_size=1
    )


def test_warmup_then_decay_to_min_lr():
    for decay in ("cosine", "linear"):
        c = cfg(f"optim.decay={decay}")
        assert [lr_at(s, c) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])  # step + 1 of 10
        assert lr_at(10, c) == pytest.approx(1e-3) and lr_at(100, c) == pytest.approx(1e-4)
        assert lr_at(500, c) == pytest.approx(1e-4)  # past train.steps: held at min_lr
        half = 1e-4 + 0.9e-3 * (0.5 * (1 + math.cos(math.pi * 0.5)) if decay == "cosine" else 0.5)
        assert lr_at(55, c) == pytest.approx(half)
    assert lr_at(70, cfg("optim.decay=constant")) == 1e-3


def test_a_resume_that_moves_the_next_lr_says_so():
    saved = {"train": {"steps": 100}, "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "decay": "cosine"}}
    assert schedule_change(saved, cfg(), 80) is None  # the same schedule
    assert schedule_change(saved, cfg("train.micro_batch_size=4"), 80) is None  # not a schedule setting
    longer = schedule_change(saved, cfg("train.steps=200"), 80)  # a stretched cosine: the lr jumps back up
    assert longer == (
        f"this resume changes the learning-rate schedule (train.steps: 100 -> 200): step 81 trains at "
        f"lr {lr_at(80, cfg('train.steps=200')):.2e}, where the saved run's schedule gives "
        f"{lr_at(80, cfg()):.2e} (step 80 had {lr_at(79, cfg()):.2e})"
    )
    assert lr_at(80, cfg("train.steps=200")) > 2 * lr_at(80, cfg())
    assert "optim.lr: 0.001 -> 0.002" in schedule_change(saved, cfg("optim.lr=2e-3"), 80)
    assert schedule_change(saved, cfg("optim.warmup_steps=5"), 3) is not None
    # A change that leaves the next lr alone (the decay's end moved while the lr is held constant) is not news.
    assert (
        schedule_change(
            {**saved, "optim": {**saved["optim"], "decay": "constant"}},
            cfg("optim.decay=constant", "train.steps=300"),
            50,
        )
        is None
    )
