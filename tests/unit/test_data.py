"""Data: prepare_data end to end on local files, windows, and the DP-independent resumable order."""

import gzip
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from megatron_lite.data.dataset import TokenData, WindowDataset
from megatron_lite.data.sampler import (
    BLEND_BLOCK,
    Blend,
    Cycled,
    MicroBatches,
    Shuffled,
    block_counts,
    global_sample_index,
    open_streams,
    val_batches,
)
from tools import prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK8K = os.path.join(ROOT, "assets", "tokenizers", "shakespeare-8k")
DOCS = [
    "To be, or not to be: that is the question.",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen, lend me your ears;",
    "All the world's a stage",
]


@pytest.fixture(scope="module")
def tok8k():
    return AutoTokenizer.from_pretrained(TOK8K)


def test_bundled_tokenizers_load_with_autotokenizer(tok8k):
    gpt2 = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tokenizers", "gpt2"))
    assert len(gpt2) == 50257 and gpt2.eos_token_id == 50256
    assert gpt2("Hello world!")["input_ids"] == [15496, 995, 0]
    assert len(tok8k) == 8192 and tok8k.eos_token == "<|endoftext|>"
    assert tok8k.decode(tok8k(DOCS[0])["input_ids"]) == DOCS[0]
    with open(os.path.join(TOK8K, "tokenizer_config.json")) as f:  # a class name transformers 4.x knows too
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"


def write_docs(src, fmt: str, docs=DOCS) -> list[str]:
    """Write docs in one format under src; return the extra prepare_data arguments it needs."""
    src.mkdir()
    if fmt == "txt":
        for i, doc in enumerate(docs):
            (src / f"{i}.txt").write_text(doc)
    elif fmt in ("jsonl", "jsonl.gz"):
        key = "body" if fmt == "jsonl.gz" else "text"  # also exercises --text-key
        lines = "".join(json.dumps({key: d, "title": "t"}) + "\n" for d in docs)
        if fmt == "jsonl":
            (src / "docs.jsonl").write_text(lines)
        else:
            with gzip.open(src / "docs.jsonl.gz", "wt") as f:
                f.write(lines)
        return ["--text-key", key]
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), src / "docs.parquet")
    return []


def split_texts(out, split: str, tok) -> list[str]:
    """Decode every document of a prepared split, checking it ends in (and only in) eos."""
    data = TokenData(str(out))
    tokens = np.asarray(getattr(data, split))
    offsets = np.load(out / f"{split}.idx.npy")
    assert offsets.dtype == np.int64 and (len(offsets) == 0 or offsets[0] == 0)
    texts = []
    for start, end in zip(offsets, [*offsets[1:], len(tokens)]):
        assert tokens[end - 1] == tok.eos_token_id and tok.eos_token_id not in tokens[start : end - 1]
        texts.append(tok.decode(tokens[start : end - 1].tolist()))
    return texts


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz", "parquet"])
def test_prepare_data_round_trips_documents(fmt, tmp_path, tok8k):
    extra = write_docs(tmp_path / "src", fmt)
    out = tmp_path / "out"
    meta = prepare_data.main(
        [
            "--input",
            str(tmp_path / "src"),
            "--tokenizer",
            TOK8K,
            "--out",
            str(out),
            "--val-fraction",
            "0.25",
            "--seed",
            "3",
            *extra,
        ]
    )
    data = TokenData(str(out))
    lengths = [len(tok8k(d, add_special_tokens=False)["input_ids"]) + 1 for d in DOCS]  # + eos
    val_doc = np.random.default_rng(3).permutation(len(DOCS))[-1]  # the last document after the seeded shuffle
    assert (
        meta
        == data.meta
        == {
            "dtype": "uint16",
            "vocab_size": 8192,
            "eos_id": tok8k.eos_token_id,
            "tokenizer": "assets/tokenizers/shakespeare-8k",
            "train_tokens": sum(lengths) - lengths[val_doc],
            "val_tokens": lengths[val_doc],
            "n_docs_train": 3,
            "n_docs_val": 1,
            "sources": meta["sources"],
        }
    )
    assert len(meta["sources"]) == (4 if fmt == "txt" else 1)
    assert data.train.dtype == np.uint16 and not data.train.flags.writeable
    assert split_texts(out, "train", tok8k) == [d for i, d in enumerate(DOCS) if i != val_doc]
    assert split_texts(out, "val", tok8k) == [DOCS[val_doc]]
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]  # no temp dir left behind


def test_prepare_data_single_document_has_empty_val(tmp_path, tok8k):
    write_docs(tmp_path / "src", "txt", DOCS[:1])
    meta = prepare_data.main(["--input", str(tmp_path / "src"), "--tokenizer", TOK8K, "--out", str(tmp_path / "out")])
    data = TokenData(str(tmp_path / "out"))
    assert (meta["n_docs_train"], meta["n_docs_val"], meta["val_tokens"], len(data.val)) == (1, 0, 0, 0)
    assert split_texts(tmp_path / "out", "train", tok8k) == DOCS[:1]
    with pytest.raises(ValueError, match="val-fraction"):
        WindowDataset(data.val, seq_len=8)


def test_prepare_data_replaces_only_its_own_output(tmp_path):
    write_docs(tmp_path / "src", "txt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not data")
    args = ["--input", str(tmp_path / "src"), "--tokenizer", TOK8K, "--out", str(out)]
    with pytest.raises(SystemExit, match="not prepared data"):
        prepare_data.main(args)
    assert os.listdir(out) == ["notes.txt"]
    (out / "notes.txt").unlink()
    first = prepare_data.main(args)
    assert prepare_data.main(args) == first  # a previous output is replaced, the split is deterministic
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_windows_overlap_by_one_token():
    ds = WindowDataset(np.arange(100, dtype=np.uint16), seq_len=8)
    assert len(ds) == 12 and ds[0].dtype == torch.int64 and ds[0].shape == (9,)
    assert ds[1].tolist() == list(range(8, 17)) and ds[11].tolist() == list(range(88, 97))
    with pytest.raises(IndexError):
        ds[12]
    with pytest.raises(ValueError, match="seq_len"):
        WindowDataset(np.arange(8, dtype=np.uint16), seq_len=8)


class Identity:
    """A dataset whose sample i is the tensor [i], to read orders directly."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def step_samples(dp: int, steps: int, consumed: int = 0, seed: int = 7, n: int = 50) -> list[list[int]]:
    """Per step of a global batch of 16, the samples all DP ranks see, in (micro-batch, rank) order."""
    ranks = [MicroBatches(Shuffled(Identity(n), (seed,)), 16, 2, r, dp, consumed) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [[b.flatten().tolist() for b in r.next_step()] for r in ranks]
        assert all(len(batches) == 16 // (2 * dp) for batches in per_rank)
        out.append([s for j in range(16 // (2 * dp)) for r in range(dp) for s in per_rank[r][j]])
    assert all(r.consumed_samples == consumed + 16 * steps for r in ranks)
    return out


def test_global_order_is_independent_of_dp_size():
    one = step_samples(1, 6)  # 96 samples of a 50-sample dataset: crosses an epoch boundary
    assert one == [[global_sample_index(7, 50, k * 16 + m) for m in range(16)] for k in range(6)]
    for dp in (2, 4, 8):
        steps = step_samples(dp, 6)
        assert [set(s) for s in steps] == [set(s) for s in one]  # the same samples per step ...
        assert steps == one  # ... and the (micro-batch, rank) concatenation is the dp=1 order


def test_resume_from_consumed_samples_continues_the_stream():
    assert step_samples(2, 3, consumed=3 * 16) == step_samples(2, 6)[3:]
    assert step_samples(4, 3, consumed=3 * 16) == step_samples(1, 6)[3:]  # resumed at another dp size


def test_epochs_reshuffle_and_seeds_differ():
    e0, e1 = [global_sample_index(1, 10, i) for i in range(10)], [global_sample_index(1, 10, i) for i in range(10, 20)]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert [global_sample_index(2, 10, i) for i in range(10)] != e0
    assert global_sample_index(1, 10, 3) == e0[3]  # a pure function: asking again, out of order, agrees


def test_val_batches_are_the_same_samples_at_every_dp_size():
    """An iteration is one global batch, dealt over dp like a training step: the set (and so val_loss) does not
    depend on dp or the micro-batch size; micro-batch j of rank r matches the training stream's layout."""
    ds = Identity(40)
    whole = torch.cat(val_batches(Cycled(ds), 8, 2, 0, 1, 3)).flatten().tolist()
    assert whole == list(range(24))
    for micro, dp in ((2, 2), (4, 2), (1, 4), (2, 4), (8, 1)):
        parts = [val_batches(Cycled(ds), 8, micro, r, dp, 3) for r in range(dp)]
        accum = 8 // (micro * dp)
        assert all(len(p) == 3 * accum and all(len(b) == micro for b in p) for p in parts)
        # micro-batch j of iteration k on rank r: samples k*8 + (j*dp + r)*micro ...
        merged = [
            s
            for k in range(3)
            for j in range(accum)
            for r in range(dp)
            for s in parts[r][k * accum + j].flatten().tolist()
        ]
        assert merged == whole, (micro, dp)
    assert torch.cat(val_batches(Cycled(Identity(10)), 4, 4, 0, 1, 3)).flatten().tolist() == [*range(10), 0, 1]  # wraps


def test_one_dataset_keeps_its_stream():
    """A single data.path reads the stream earlier runs read (default_rng([seed, epoch]) a permutation per epoch), so
    their checkpoints resume onto the same samples."""
    stream = Shuffled(Identity(50), (7,))
    expected = [int(np.random.default_rng([7, i // 50]).permutation(50)[i % 50]) for i in range(130)]
    assert [stream(i).item() for i in range(130)] == expected
    assert [stream(i).item() for i in (120, 3, 77)] == [expected[120], expected[3], expected[77]]  # any order


class Tagged(Identity):
    """Dataset `tag`'s sample i is the tensor [tag * 1000 + i]."""

    def __init__(self, n, tag):
        super().__init__(n)
        self.tag = tag

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return torch.tensor([self.tag * 1000 + i])


def test_block_counts_round_by_largest_remainder():
    assert block_counts([0.7, 0.2, 0.1], 10).tolist() == [7, 2, 1]
    assert block_counts([3, 1], BLEND_BLOCK).tolist() == [12288, 4096]  # weights need not sum to 1
    assert block_counts([1, 1, 1], BLEND_BLOCK).tolist() == [5462, 5461, 5461]  # ties: the earlier dataset
    assert block_counts([0.26, 0.37, 0.37], 10).tolist() == [2, 4, 4]


def test_a_blend_holds_every_share_at_every_prefix_and_reads_each_dataset_in_its_own_order():
    sizes, weights, block = (7, 40, 300), (0.5, 0.3, 0.2), 100
    streams = [Shuffled(Tagged(n, k), (5, k)) for k, n in enumerate(sizes)]
    blend = Blend(streams, list(weights), block=block)
    n = 5 * block + 37  # five blocks and part of a sixth
    tags = [blend(i).item() for i in range(n)]
    seen = np.zeros(3, dtype=np.int64)
    for i, t in enumerate(tags):
        seen[t // 1000] += 1
        assert np.abs(seen - np.asarray(weights) * (i + 1)).max() <= 1.0, (i, seen)  # within a sample at every prefix
    for k, _size in enumerate(sizes):  # dataset k's samples are its own stream, in order: none skipped or repeated
        mine = [t % 1000 for t in tags if t // 1000 == k]
        assert mine == [streams[k](j).item() % 1000 for j in range(len(mine))]
    first_epochs = [t % 1000 for t in tags if t // 1000 == 0][:35]  # the small dataset: 5 epochs, each a permutation
    assert all(sorted(first_epochs[e * 7 : (e + 1) * 7]) == list(range(7)) for e in range(5))
    assert first_epochs[:7] != first_epochs[7:14]


def test_blends_differ_by_seed_and_are_independent_of_dp():
    def blend(seed):
        return Blend([Shuffled(Tagged(n, k), (seed, k)) for k, n in enumerate((30, 50))], [1, 3], block=64)

    a, b = blend(7), blend(8)
    assert [a(i).item() for i in range(100)] != [b(i).item() for i in range(100)]
    assert [blend(7)(i).item() for i in range(100)] == [a(i).item() for i in range(100)]

    def steps(dp, consumed=0, n_steps=5):
        ranks = [MicroBatches(blend(7), 16, 2, r, dp, consumed) for r in range(dp)]
        out = []
        for _ in range(n_steps):
            per_rank = [[b.flatten().tolist() for b in r.next_step()] for r in ranks]
            out.append([s for j in range(16 // (2 * dp)) for r in range(dp) for s in per_rank[r][j]])
        return out

    one = steps(1)
    assert [s for step in one for s in step] == [a(i).item() for i in range(80)]
    assert steps(2) == steps(4) == one
    assert steps(4, consumed=32, n_steps=3) == one[2:]  # resumed at another dp size


def test_open_streams_blends_prepared_directories(tmp_path, tok8k):
    dirs = []
    for k, docs in enumerate((DOCS, [d.upper() for d in DOCS] * 3)):
        write_docs(tmp_path / f"src{k}", "txt", docs)
        prepare_data.main(
            [
                "--input",
                str(tmp_path / f"src{k}"),
                "--tokenizer",
                TOK8K,
                "--out",
                str(tmp_path / f"out{k}"),
                "--val-fraction",
                "0.25",
            ]
        )
        dirs.append(str(tmp_path / f"out{k}"))
    seq = 4
    windows = [WindowDataset(TokenData(d).train, seq) for d in dirs]
    vals = [WindowDataset(TokenData(d).val, seq) for d in dirs]
    streams = open_streams(dirs, None, seq, seed=3, validation=True)
    assert streams.samples == [len(w) for w in windows] and streams.weights == streams.samples  # unset: by size
    counts = block_counts(streams.weights)
    for i in range(0, 3 * BLEND_BLOCK, 997):  # every sample is a window of the dataset the blend names
        k, j = streams.train.locate(i)
        assert torch.equal(streams.train(i), windows[k][streams.train.streams[k].index(j)])
        assert j < (i // BLEND_BLOCK + 1) * counts[k]
        kv, jv = streams.val.locate(i)
        assert torch.equal(streams.val(i), vals[kv][jv % len(vals[kv])]) and kv == k  # val: the same layout, in order
    assert open_streams(dirs, [1, 1], seq, seed=3, validation=False).val is None
    assert streams.val_each is None and open_streams(dirs[0], None, seq, 3, validation=True, each=True).val_each is None
    each = open_streams(dirs, [1, 1], seq, seed=3, validation=True, each=True).val_each  # train.eval_per_dataset
    assert list(each) == dirs and all(
        torch.equal(each[d](i), vals[k][i % len(vals[k])])
        for k, d in enumerate(dirs)
        for i in range(2 * len(vals[k]) + 1)
    )
    one = open_streams(dirs[0], None, seq, seed=3, validation=False).train
    assert [one(i).tolist() for i in range(9)] == [
        windows[0][global_sample_index(3, len(windows[0]), i)].tolist() for i in range(9)
    ]


def test_prepare_data_skips_empty_files_and_textless_records_and_names_bad_input(tmp_path, tok8k):
    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.jsonl").write_text("")
    (src / "docs.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"text": DOCS[0]}, {"text": None}, {"title": "no text"}, {"text": ""}, {"text": DOCS[1]}]
        )
    )
    out = tmp_path / "out"
    meta = prepare_data.main(["--input", str(src), "--tokenizer", TOK8K, "--out", str(out), "--val-fraction", "0.5"])
    assert meta["n_docs_train"] + meta["n_docs_val"] == 2  # the two records with text
    assert sorted(split_texts(out, "train", tok8k) + split_texts(out, "val", tok8k)) == sorted(DOCS[:2])
    assert meta["sources"] == [str(src / "docs.jsonl")]  # not the empty file
    assert meta["tokenizer"] == "assets/tokenizers/shakespeare-8k"  # inside the repo: relative to its root
    for args, message in (
        (["--input", str(src / "empty.jsonl")], r"every input file is empty"),
        (["--input", str(src), "--tokenizer", str(tmp_path / "nope")], r"--tokenizer \S+/nope is not a directory"),
        (["--input", str(src), "--tokenizer", str(src)], r"--tokenizer \S+/src could not be loaded"),
    ):
        with pytest.raises(SystemExit, match=f"^prepare_data: {message}"):
            prepare_data.main(
                [*args, *(["--tokenizer", TOK8K] if "--tokenizer" not in args else []), "--out", str(tmp_path / "out2")]
            )
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match=r"^prepare_data: \S+/bad.jsonl could not be read as json \(.*\); check"):
        prepare_data.main(["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", TOK8K, "--out", str(tmp_path / "o3")])
    assert not (tmp_path / "out2").exists() and not (tmp_path / "o3").exists()


def test_prepare_data_reads_what_it_should_and_names_what_it_cannot(tmp_path, tok8k):
    """.txt files beside records of another --text-key; a second run whose --out is inside its --input (the first
    run's output is not read as documents); then one line naming the file at fault: a non-UTF-8 .txt among
    good ones (and the decoder's error), a text field that is not a string, a datasets.save_to_disk directory."""
    src = tmp_path / "src"
    write_docs(src, "txt", DOCS[:2])
    (src / "more.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[2:]))
    for _ in range(2):
        meta = prepare_data.main(
            [
                "--input",
                str(src),
                "--text-key",
                "body",
                "--tokenizer",
                TOK8K,
                "--out",
                str(src / "prepared"),
                "--val-fraction",
                "0.5",
            ]
        )
        texts = split_texts(src / "prepared", "train", tok8k) + split_texts(src / "prepared", "val", tok8k)
        assert sorted(texts) == sorted(DOCS) and len(meta["sources"]) == 3, meta["sources"]
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(
        SystemExit,
        match=r"^prepare_data: \S+/src/latin1.txt could not be read as text "
        r"\(UnicodeDecodeError: 'utf-8' codec can't decode .*\(text is read as UTF-8\)$",
    ):
        prepare_data.main(["--input", str(src), "--tokenizer", TOK8K, "--out", str(tmp_path / "o1")])
    (tmp_path / "ints.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(SystemExit, match=r"^prepare_data: --text-key text of \S+/ints.jsonl holds Value\('int64'\)"):
        prepare_data.main(
            ["--input", str(tmp_path / "ints.jsonl"), "--tokenizer", TOK8K, "--out", str(tmp_path / "o2")]
        )
    saved = tmp_path / "saved"
    saved.mkdir()
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (saved / name).write_text("{}")
    with pytest.raises(SystemExit, match=r"^prepare_data: --input \S+/saved is a datasets.save_to_disk directory"):
        prepare_data.main(["--input", str(saved), "--tokenizer", TOK8K, "--out", str(tmp_path / "o3")])


def test_train_tokenizer_on_your_documents_then_prepare_with_it(tmp_path):
    from tools import train_tokenizer

    extra = write_docs(tmp_path / "src", "jsonl.gz", DOCS * 5)  # field "body"
    out = tmp_path / "tok"
    train_tokenizer.main(["--input", str(tmp_path / "src"), *extra, "--out", str(out), "--vocab-size", "300"])
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 300 and tok.eos_token == "<|endoftext|>"
    assert all(tok.decode(tok(d)["input_ids"]) == d for d in DOCS)
    assert len(tok(DOCS[0])["input_ids"]) < len(DOCS[0].encode())  # it learned merges from the documents
    meta = prepare_data.main(
        ["--input", str(tmp_path / "src"), *extra, "--tokenizer", str(out), "--out", str(tmp_path / "data")]
    )
    assert meta["vocab_size"] == 300 and meta["eos_id"] == tok.eos_token_id
    with pytest.raises(SystemExit, match="--vocab-size 100 is below the 256 bytes"):
        train_tokenizer.main(["--input", str(tmp_path / "src"), "--out", str(tmp_path / "t2"), "--vocab-size", "100"])
    with pytest.raises(SystemExit, match="--input and --out go together"):
        train_tokenizer.main(["--out", str(tmp_path / "t3")])
    # its input errors name it, not prepare_data, whose readers it shares
    with pytest.raises(SystemExit, match=r"^train_tokenizer: --input \S+/nosuch does not exist$"):
        train_tokenizer.main(["--input", str(tmp_path / "nosuch"), "--out", str(tmp_path / "t4")])
    with pytest.raises(SystemExit, match=r"^train_tokenizer: --text-key text is not a field of "):
        train_tokenizer.main(["--input", str(tmp_path / "src"), "--out", str(tmp_path / "t5")])
