"""Tokenize local documents into the flat token memmap the trainer reads.

    python tools/prepare_data.py --tokenizer assets/tokenizers/shakespeare-8k --out data/shakespeare-8k
    python tools/prepare_data.py --input my_docs/ more.jsonl.gz --text-key body --tokenizer <dir> --out data/mine

Inputs: files or directories of .txt (one document per file), .json/.jsonl (one document per record,
field --text-key) and .parquet, optionally gzipped; default: the bundled Shakespeare corpus. Inside a
directory, files of other types are skipped (and listed); a file named on the command line must be one of these. HF `datasets`
reads them (offline), a local HF tokenizer encodes them with `.map(batched=True)` (progress bar), an eos
token ends every document. Documents are split into train/val by a seeded shuffle (val = the last
--val-fraction of documents, at least one).

Output (written to a temporary directory, then renamed, so a killed run leaves nothing half-written; an
existing --out is replaced only if it is empty or a previous output, i.e. has a meta.json):
  train.bin, val.bin           flat token ids (uint16 when the vocabulary fits, else uint32); val is empty
                               (with a warning) when there is a single document
  train.idx.npy, val.idx.npy   int64 start offset of every document (the index)
  meta.json                    dtype, vocab_size, eos_id, tokenizer, token and document counts, sources
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_INPUT = os.path.join(ROOT, "assets", "corpus", "shakespeare.jsonl.gz")
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _resolve(path: str) -> str:
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)


def recorded_path(path: str) -> str:
    """How meta.json names a tokenizer so that train.py and the tools find it from anywhere (they resolve a
    relative path against the repo root): relative to the repo root inside it, else absolute."""
    full = os.path.abspath(_resolve(path))
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else full


def _builder(path: str, tool: str) -> str:
    stem = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(stem)[1]
    if ext not in BUILDERS:
        raise SystemExit(f"{tool}: {path} has an unsupported type {ext!r}; use .txt, .json, .jsonl or .parquet")
    return BUILDERS[ext]


def _supported(path: str) -> bool:
    stem = path[:-3] if path.endswith(".gz") else path
    return os.path.splitext(stem)[1] in BUILDERS


def _prepared(directory: str) -> bool:
    """Whether a directory is (or is being written as) this tool's output: not documents to read."""
    name = os.path.basename(directory)
    return (
        name.startswith((".prepare_", ".prepare_old_"))
        or os.path.isfile(os.path.join(directory, "meta.json"))
        and os.path.isfile(os.path.join(directory, "train.bin"))
    )


def collect_files(inputs: list[str], tool: str = "prepare_data") -> dict[str, list[str]]:
    """Group input files by HF `datasets` builder (text/json/parquet). tool: the program its messages name."""
    groups: dict[str, list[str]] = {}
    for item in inputs:
        item = _resolve(item)
        if not os.path.exists(item):
            raise SystemExit(f"{tool}: --input {item} does not exist")
        if os.path.isdir(item) and all(
            os.path.isfile(os.path.join(item, f)) for f in ("state.json", "dataset_info.json")
        ):
            raise SystemExit(
                f"{tool}: --input {item} is a datasets.save_to_disk directory, which is not read "
                "here; write it out with ds.to_json('docs.jsonl') or ds.to_parquet('docs.parquet')"
            )
        if os.path.isdir(item):
            found = []
            for d, dirs, fs in os.walk(item):  # prepared data (a previous --out inside the input) is skipped
                dirs[:] = sorted(x for x in dirs if not _prepared(os.path.join(d, x)))
                found += [os.path.join(d, f) for f in sorted(fs)]
            files = [f for f in found if _supported(f)]
            if skipped := [os.path.relpath(f, item) for f in found if not _supported(f)]:
                print(
                    f"{tool}: skipping {len(skipped)} file(s) of other types in {item}: "
                    f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}",
                    file=sys.stderr,
                )
            if not files:
                raise SystemExit(f"{tool}: --input {item} holds no .txt, .json, .jsonl or .parquet files")
        else:
            files = [item]
        for f in files:
            groups.setdefault(_builder(f, tool), []).append(f)
    return groups


def _innermost(err: BaseException) -> BaseException:
    """The error at the bottom of a chain (datasets wraps the reader's own error in DatasetGenerationError)."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    return err


def _load(datasets, builder: str, files: list[str], cache_dir: str):
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)


def _unreadable(datasets, builder: str, files: list[str], err: Exception, cache_dir: str, tool: str) -> SystemExit:
    """One line naming the file that fails (found by reading the group's files one at a time) and why."""
    for path in files if len(files) > 1 else []:
        try:
            _load(datasets, builder, [path], cache_dir)
        except Exception as single:  # noqa: PERF203 - the error path only
            err, files = single, [path]
            break
    cause = _innermost(err)
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return SystemExit(
        f"{tool}: {', '.join(files[:3])} could not be read as {builder} "
        f"({type(cause).__name__}{': ' + first if first else ''}); check the file's format"
        + (" (text is read as UTF-8)" if isinstance(cause, UnicodeDecodeError) else "")
    )


def load_documents(groups: dict[str, list[str]], text_key: str, cache_dir: str, tool: str = "prepare_data"):
    """One dataset with a single "text" column, one row per document. Empty files are dropped from `groups`
    (so they are not listed as sources); --text-key names the field of json/parquet records (a .txt file is one
    document). tool: the program its messages name."""
    import datasets

    # HF_DATASETS_OFFLINE (set above) is read when `datasets` is first imported; an in-process caller may
    # have imported it earlier, and then every packaged loader pings the Hub (3 s time-out) for local files.
    was_offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    try:
        parts = []
        for builder, files in list(groups.items()):
            empty = [f for f in files if os.path.getsize(f) == 0]
            if empty:
                print(f"{tool}: skipping {len(empty)} empty file(s): {', '.join(empty[:3])}", file=sys.stderr)
                files = groups[builder] = [f for f in files if f not in empty]
                if not files:
                    del groups[builder]
                    continue
            try:
                ds = _load(datasets, builder, files, cache_dir)
            except Exception as err:  # datasets' own errors name neither the file nor the cause on one line
                raise _unreadable(datasets, builder, files, err, cache_dir, tool) from None
            key = "text" if builder == "text" else text_key
            if key not in ds.column_names:
                raise SystemExit(
                    f"{tool}: --text-key {key} is not a field of {files[0]} (fields: {', '.join(ds.column_names)})"
                )
            kind = ds.features[key]
            if not (isinstance(kind, datasets.Value) and kind.dtype in ("string", "large_string")):
                raise SystemExit(
                    f"{tool}: --text-key {key} of {', '.join(files[:3])} holds {kind}, not text; "
                    "give the field that holds each document's text as a string"
                )
            parts.append(
                ds.select_columns([key]).rename_column(key, "text") if key != "text" else ds.select_columns(["text"])
            )
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline
    if not parts:
        raise SystemExit(f"{tool}: every input file is empty; give files that hold documents")
    docs = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    import pyarrow.compute as pc

    # a record with the field null or absent (null in the column) or "" has no text: not a document
    empty = pc.fill_null(pc.equal(pc.binary_length(docs.data.column("text")), 0), True).to_numpy(zero_copy_only=False)
    if empty.any():
        print(
            f"{tool}: skipping {int(empty.sum())} record(s) without text in {text_key!r} (null, missing or empty)",
            file=sys.stderr,
        )
        docs = docs.select(np.flatnonzero(~empty))
    return docs


def write_split(ds, out_dir: str, name: str, dtype) -> tuple[int, int]:
    """Write <name>.bin and <name>.idx.npy; return (tokens, documents)."""
    lengths = np.asarray(ds["length"], dtype=np.int64).reshape(-1)  # (n_docs,), eos included
    offsets = np.cumsum(lengths) - lengths  # (n_docs,) start of each document
    total = int(lengths.sum())
    # numpy cannot map an empty file: an empty split gets one padding element (meta.json says 0 tokens).
    tokens = np.memmap(os.path.join(out_dir, f"{name}.bin"), dtype=dtype, mode="w+", shape=(max(total, 1),))
    for start, batch in zip(range(0, len(ds), 1024), ds.iter(batch_size=1024)):
        flat = np.concatenate([np.asarray(ids, dtype=dtype) for ids in batch["ids"]])
        tokens[offsets[start] : offsets[start] + len(flat)] = flat
    tokens.flush()
    np.save(os.path.join(out_dir, f"{name}.idx.npy"), offsets)
    return total, len(ds)


def _swap_in(tmp: str, out: str) -> None:
    """Move the finished tmp dir to out; a previous out is moved aside first and deleted last."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=".prepare_old_", dir=os.path.dirname(out))
        os.replace(out, os.path.join(old, "data"))
    os.replace(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=[DEFAULT_INPUT], help="files or directories")
    ap.add_argument(
        "--text-key",
        default="text",
        help="field holding the text in json/parquet records (a .txt file is one document)",
    )
    ap.add_argument("--tokenizer", default="assets/tokenizers/shakespeare-8k", help="local HF tokenizer dir")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the train/val document split")
    ap.add_argument("--num-proc", type=int, default=None, help="tokenizer processes for datasets.map")
    args = ap.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        raise SystemExit(f"prepare_data: --val-fraction {args.val_fraction} must be in [0, 1); use e.g. 0.01")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"prepare_data: --out {args.out} is a file; give a directory path")
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, "meta.json")):
        raise SystemExit(
            f"prepare_data: --out {args.out} exists and is not prepared data (no meta.json); "
            "it would be replaced, so pick a new directory or empty it first"
        )

    from transformers import AutoTokenizer

    t0 = time.time()
    if not os.path.isdir(_resolve(args.tokenizer)):
        raise SystemExit(
            f"prepare_data: --tokenizer {args.tokenizer} is not a directory; give a local HF tokenizer "
            "directory (e.g. assets/tokenizers/gpt2, or one made by tools/train_tokenizer.py)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(_resolve(args.tokenizer))
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"prepare_data: --tokenizer {args.tokenizer} could not be loaded "
            f"({str(err).strip().splitlines()[0]}); give a local HF tokenizer directory"
        ) from None
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SystemExit(f"prepare_data: tokenizer {args.tokenizer} has no eos token; documents need a separator")
    dtype = np.uint16 if len(tokenizer) < 2**16 else np.uint32
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare_", dir=parent)
    try:
        groups = collect_files(args.input)
        docs = load_documents(groups, args.text_key, cache_dir=os.path.join(tmp, "hf_cache"))
        if len(docs) == 0:
            raise SystemExit(f"prepare_data: --input {' '.join(args.input)} holds no documents")

        def encode(batch):
            ids = [row + [eos] for row in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]
            return {"ids": ids, "length": [len(r) for r in ids]}

        docs = docs.map(encode, batched=True, remove_columns=["text"], num_proc=args.num_proc, desc="tokenizing")
        # At least one val document, but never all of them: a single document leaves val empty.
        n_val = min(max(1, round(len(docs) * args.val_fraction)), len(docs) - 1)
        if n_val == 0:
            print(
                "prepare_data: warning: a single document, so the val split is empty "
                "(train with train.eval_interval=0 or give more documents)",
                file=sys.stderr,
            )
        order = np.random.default_rng(args.seed).permutation(len(docs))
        train_ds, val_ds = (
            docs.select(sorted(order[: len(docs) - n_val])),
            docs.select(sorted(order[len(docs) - n_val :])),
        )
        train_tokens, n_train = write_split(train_ds, tmp, "train", dtype)
        val_tokens, n_val = write_split(val_ds, tmp, "val", dtype)
        meta = {
            "dtype": np.dtype(dtype).name,
            "vocab_size": len(tokenizer),
            "eos_id": eos,
            "tokenizer": recorded_path(args.tokenizer),
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "n_docs_train": n_train,
            "n_docs_val": n_val,
            "sources": [recorded_path(f) for fs in groups.values() for f in fs],
        }
        shutil.rmtree(os.path.join(tmp, "hf_cache"), ignore_errors=True)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"prepared {out}: {train_tokens:,} train + {val_tokens:,} val tokens "
        f"({n_train} + {n_val} documents) in {time.time() - t0:.1f} s",
        file=sys.stderr,
    )
    return meta


if __name__ == "__main__":
    main()
