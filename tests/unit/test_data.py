"""Data: prepare_data end to end on local files, windows, and the DP-independent resumable order."""

import gzip
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from megatron_lite.data.dataset import TokenData, WindowDataset
from megatron_lite.data.sampler import GlobalOrder, MicroBatches, val_batches
from tools import prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK8K = os.path.join(ROOT, "assets", "tokenizers", "shakespeare-8k")
DOCS = ["To be, or not to be: that is the question.", "Now is the winter of our discontent",
        "Friends, Romans, countrymen, lend me your ears;", "All the world's a stage"]


def test_bundled_tokenizers_load_with_autotokenizer():
    gpt2 = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tokenizers", "gpt2"))
    assert len(gpt2) == 50257 and gpt2.eos_token_id == 50256
    assert gpt2("Hello world!")["input_ids"] == [15496, 995, 0]
    small = AutoTokenizer.from_pretrained(TOK8K)
    assert len(small) == 8192 and small.decode(small(DOCS[0])["input_ids"]) == DOCS[0]


@pytest.mark.parametrize("fmt", ["txt", "jsonl.gz", "parquet"])
def test_prepare_data_round_trips_documents(fmt, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "txt":
        for i, doc in enumerate(DOCS):
            (src / f"{i}.txt").write_text(doc)
    elif fmt == "jsonl.gz":
        with gzip.open(src / "docs.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"body": d}) + "\n" for d in DOCS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), src / "docs.parquet")
    out = tmp_path / "out"
    key = ["--text-key", "body"] if fmt == "jsonl.gz" else []
    meta = prepare_data.main(["--input", str(src), "--tokenizer", TOK8K, "--out", str(out), "--val-fraction",
                              "0.25", *key])
    data = TokenData(str(out))
    assert meta == data.meta and meta["n_docs_train"] == 3 and meta["n_docs_val"] == 1
    tok = AutoTokenizer.from_pretrained(TOK8K)
    eos = tok.eos_token_id
    texts = []
    for split in ("train", "val"):
        tokens = np.asarray(getattr(data, split))
        offsets = np.load(out / f"{split}.idx.npy")
        ends = list(offsets[1:]) + [len(tokens)]
        for start, end in zip(offsets, ends):
            assert tokens[end - 1] == eos and eos not in tokens[start:end - 1]
            texts.append(tok.decode(tokens[start:end - 1].tolist()))
    assert sorted(texts) == sorted(DOCS)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".prepare_")]  # no temp dir left


def test_windows_overlap_by_one_token():
    ds = WindowDataset(np.arange(100, dtype=np.uint16), seq_len=8)
    assert len(ds) == 12 and ds[0].dtype == torch.int64
    assert ds[1].tolist() == list(range(8, 17))
    with pytest.raises(ValueError, match="seq_len"):
        WindowDataset(np.arange(5, dtype=np.uint16), seq_len=8)


class Identity:
    """A dataset whose sample i is the tensor [i], to read orders directly."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def stack(self, indices):
        return torch.tensor([[int(i)] for i in indices])


def step_samples(dp: int, steps: int, consumed: int = 0, seed: int = 7, n: int = 50) -> list[list[int]]:
    """Per step, the samples all DP ranks see, in (micro-batch, rank) order."""
    ranks = [MicroBatches(Identity(n), seed, 16, 2, r, dp, consumed) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [[b.flatten().tolist() for b in r.next_step()] for r in ranks]
        accum = len(per_rank[0])
        out.append([s for j in range(accum) for r in range(dp) for s in per_rank[r][j]])
    return out


def test_global_order_is_independent_of_dp_size():
    one = step_samples(1, 6)
    assert step_samples(2, 6) == one and step_samples(4, 6) == one and step_samples(8, 6) == one


def test_resume_from_consumed_samples_continues_the_stream():
    assert step_samples(2, 3, consumed=3 * 16) == step_samples(2, 6)[3:]


def test_epochs_reshuffle_and_seeds_differ():
    order = GlobalOrder(10, seed=1)
    e0, e1 = [order[i] for i in range(10)], [order[i] for i in range(10, 20)]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    other = GlobalOrder(10, seed=2)
    assert [other[i] for i in range(10)] != e0


def test_val_batches_are_fixed_and_split_over_ranks():
    ds = Identity(10)
    whole = torch.cat(val_batches(ds, 2, 0, 1, 4)).flatten().tolist()
    parts = [val_batches(ds, 2, r, 2, 2) for r in range(2)]
    merged = [s for k in range(2) for r in range(2) for s in parts[r][k].flatten().tolist()]
    assert merged == whole == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9][:8]
