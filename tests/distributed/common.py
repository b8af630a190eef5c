"""Shared settings for the multi-rank trajectory tests: a tiny model, a short schedule, fp32 on CPU, and the
prepared corpus folded into a 512-token vocabulary (TEST_VOCAB; folded_corpus): the tiny presets' 8192-token
head is most of a step's time on CPU and none of what these tests compare. The recorded losses and the fault
tests train on the real corpus (real_corpus_overrides).

Trajectory tests compare the per-step loss and the per-step gradient norm (before clipping). Both are
needed: Adam's update is invariant to the gradient's scale (and clipping at train.grad_clip=1.0 rescales
every step of these tiny models, whose norms are 1.5-3.5), so a gradient that is 2x too large (a wrong
accumulation or DP averaging factor) leaves the losses unchanged to 5e-7; the gradient norm doubles.
Losses are compared in absolute terms (their scale, ~ln(vocab), is the same in every test), gradient norms
relative to the reference (their size depends on the model and the step)."""

import functools
import json
import os

import numpy as np

from megatron_lite.engine.ds_config import async_io_available  # noqa: F401  (the tests' skip condition)
from tests.distributed.launcher import ROOT, SCRATCH

# 8 sequences per step: accumulation 4 at dp=1, 2 at dp=2, 1 at dp=4 (same global batch every time).
BASE = [
    "train.steps=6",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "checkpoint.interval=0",
    "checkpoint.resume=never",
    "logging.wandb.mode=disabled",
    "train.precision=fp32",
]


TEST_VOCAB = 512
REAL_CORPUS = ["data.path=data/shakespeare-8k", "model.vocab_size=8192"]


def overrides(tmp_path, name: str, *extra: str, real_corpus: bool = False) -> list[str]:
    return [*BASE, *(REAL_CORPUS if real_corpus else test_corpus()), f"run.dir={tmp_path}/{name}", *extra]


def real_corpus_overrides(tmp_path, name: str, *extra: str) -> list[str]:
    """overrides on the real corpus's settings and its 8192-token head: for the recorded losses, for the fault
    tests, whose timing (the steps a signal, a kill or a joining node must land among) and long-run tolerances were
    measured with it, and under a data.path of a test's own with the full vocabulary (tests/gpu: the lease has no
    data/, and this reads nothing from it). On the folded corpus steps are twice as fast and the loss falls below 1
    by step 17, where an elastic resume's reordered sums then part by 1e-3 instead of 1e-4."""
    return overrides(tmp_path, name, *extra, real_corpus=True)


@functools.cache
def test_corpus() -> tuple[str, ...]:
    """The folded corpus, written once per test session (in its scratch directory, removed when it ends)."""
    return tuple(folded_corpus(os.path.join(SCRATCH, f"corpus_{TEST_VOCAB}"), TEST_VOCAB))


test_corpus.__test__ = False  # a helper: pytest collected it as a test wherever a test module imported it


def write_prepared(path, splits: dict[str, np.ndarray], vocab: int) -> str:
    """A prepared data directory (what tools/prepare_data.py writes) holding the given token ids per split."""
    os.makedirs(path, exist_ok=True)
    for split, ids in splits.items():
        ids.astype(np.uint16).tofile(os.path.join(path, f"{split}.bin"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": vocab, **{f"{s}_tokens": len(ids) for s, ids in splits.items()}}, f)
    return str(path)


def folded_corpus(path, vocab: int = TEST_VOCAB, tokens: int = 40_000) -> list[str]:
    """Overrides that train on the start of the prepared corpus with every token folded into `vocab` ids (real text
    statistics, a head of `vocab` columns)."""
    splits = {}
    for split, n in {"train": tokens, "val": tokens // 10}.items():
        ids = np.fromfile(os.path.join(ROOT, "data", "shakespeare-8k", f"{split}.bin"), dtype=np.uint16, count=n)
        assert len(ids) == n, f"data/shakespeare-8k/{split}.bin holds fewer than {n} tokens (make data)"
        splits[split] = ids % vocab
    return [f"data.path={write_prepared(path, splits, vocab)}", f"model.vocab_size={vocab}"]


@functools.cache
def documents_corpus(mean_length: int = 40) -> tuple[str, ...]:
    """The folded corpus cut into short documents (lengths 1 to 3x mean_length, each ending with eos id 0) with
    their index, for data.document_mask: a 128-token window holds about three. Overrides, written once a session."""
    path = os.path.join(SCRATCH, f"documents_{TEST_VOCAB}_{mean_length}")
    splits = {}
    rng = np.random.default_rng(0)
    for split, n in {"train": 40_000, "val": 4_000}.items():
        ids = np.fromfile(os.path.join(ROOT, "data", "shakespeare-8k", f"{split}.bin"), dtype=np.uint16, count=n)
        ids = ids % TEST_VOCAB
        ids[ids == 0] = 1  # eos only where a document ends
        lengths = rng.integers(1, 3 * mean_length, size=n)
        starts = np.cumsum(lengths) - lengths
        starts = starts[starts < n]
        ids[starts[1:] - 1] = 0
        splits[split] = ids
        os.makedirs(path, exist_ok=True)
        np.save(os.path.join(path, f"{split}.idx.npy"), starts.astype(np.int64))
    write_prepared(path, splits, TEST_VOCAB)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({**meta, "eos_id": 0}, f)
    return (f"data.path={path}", f"model.vocab_size={TEST_VOCAB}", "data.document_mask=true")


documents_corpus.__test__ = False


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def max_relative_diff(a: list[float], b: list[float]) -> float:
    """max |a_i - b_i| / |b_i|, b being the reference."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def assert_same_hf_export(tmp_path, names: tuple[str, str], tol: float) -> None:
    """Export the checkpoints of two runs (run.dir = tmp_path/<name>) to HF and compare every tensor (max abs)."""
    from transformers import AutoModelForCausalLM

    from tools.convert_hf import export_hf

    models = []
    for name in names:
        export_hf(f"{tmp_path}/{name}/checkpoints", f"{tmp_path}/{name}_hf")
        models.append(AutoModelForCausalLM.from_pretrained(f"{tmp_path}/{name}_hf").state_dict())
    assert models[0].keys() == models[1].keys()
    for key, value in models[0].items():
        gap = (value - models[1][key]).abs().max().item()
        assert gap <= tol, f"{key} differs by {gap:.2e}"


def logged_records(run_dir: str) -> list[dict]:
    """The records in run_dir/metrics.jsonl so far (none before the first step; a half-written last line of a
    run still going is left out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the text after the last newline is partial
