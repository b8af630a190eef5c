"""data.*: one prepared directory or a blend of several (each one's meta.json and token files), the tokenizer,
and the blend's weights."""

from __future__ import annotations

import json
import math
import os

from megatron_lite.config import Config, data_paths, repo_path
from megatron_lite.data.sampler import BLEND_BLOCK
from megatron_lite.validation.rules import fail


def _tokenizer_of(meta: dict) -> tuple:
    """What a prepared dataset was tokenized with: the tokenizer's directory however its path was written, its
    size and end-of-document id."""
    path = meta.get("tokenizer")
    return path and os.path.realpath(repo_path(path)), meta.get("vocab_size"), meta.get("eos_id")


def _itemsize(meta: dict) -> int:
    import numpy as np

    return np.dtype(meta.get("dtype", "uint16")).itemsize


def check_data(cfg: Config) -> None:
    """data.path (one prepared directory or a blend of several) and data.weights, from each one's meta.json."""
    d, m = cfg.data, cfg.model
    if not isinstance(d.path, str) and not (
        isinstance(d.path, (list, tuple)) and d.path and all(isinstance(p, str) for p in d.path)
    ):
        fail(
            "data.path",
            d.path,
            "must be a prepared data directory or a non-empty list of them",
            "use data.path=data/mine or data.path=[data/a,data/b]",
        )
    paths = data_paths(d.path)
    key = (lambda k: "data.path") if isinstance(d.path, str) else (lambda k: f"data.path[{k}]")
    metas = []
    for k, path in enumerate(paths):
        if not os.path.exists(os.path.join(repo_path(path), "meta.json")):
            fail(
                key(k),
                path,
                "has no prepared data (meta.json missing)",
                f"run `make data` or `python tools/prepare_data.py --tokenizer {d.tokenizer or '<tokenizer dir>'} "
                f"--out {path}`",
            )
        with open(os.path.join(repo_path(path), "meta.json")) as f:
            metas.append(json.load(f))
    for k, meta in enumerate(metas[1:], 1):
        if _tokenizer_of(meta) != _tokenizer_of(metas[0]):
            fail(
                key(k),
                paths[k],
                f"was prepared with tokenizer {meta.get('tokenizer')} ({meta.get('vocab_size')} "
                f"tokens), {key(0)}={paths[0]} with {metas[0].get('tokenizer')} ({metas[0].get('vocab_size')})",
                "prepare every dataset of a blend with the same tokenizer (tools/prepare_data.py --tokenizer)",
            )
    recorded = metas[0].get("tokenizer")
    if d.tokenizer is not None:
        if not os.path.isdir(repo_path(d.tokenizer)):
            fail(
                "data.tokenizer",
                d.tokenizer,
                "is not a directory",
                "give the local HF tokenizer directory the data "
                "was prepared with, or data.tokenizer=null to take the one its meta.json records",
            )
        if (
            recorded is not None
            and os.path.isdir(repo_path(recorded))
            and os.path.realpath(repo_path(recorded)) != os.path.realpath(repo_path(d.tokenizer))
        ):
            fail(
                "data.tokenizer",
                d.tokenizer,
                f"is not the tokenizer {key(0)}={paths[0]} was prepared with ({recorded})",
                f"use data.tokenizer={recorded}, or data.tokenizer=null to take the data's",
            )
    if len(set(map(os.path.realpath, map(repo_path, paths)))) < len(paths):
        fail(
            "data.path",
            list(paths),
            "names a directory twice",
            "list each once and give it a larger data.weights entry",
        )
    for k, meta in enumerate(metas):
        for split in ("train", "val"):  # both are mapped at start-up (an empty split is one element long)
            file = os.path.join(repo_path(paths[k]), f"{split}.bin")
            tokens = meta.get(f"{split}_tokens", 0)
            held = os.path.getsize(file) // _itemsize(meta) if os.path.isfile(file) else None
            if held is None or held < max(tokens, 1):
                fail(
                    key(k),
                    paths[k],
                    f"has {'no ' + split + '.bin' if held is None else f'{held} tokens in {split}.bin'}"
                    f" where its meta.json records {tokens}",
                    "prepare it again with tools/prepare_data.py",
                )
        for split, needed, fix in (
            ("train", True, "use more data"),
            (
                "val",
                cfg.train.eval_interval > 0,
                "prepare it with a larger --val-fraction of tools/prepare_data.py, or set train.eval_interval=0",
            ),
        ):
            tokens = meta.get(f"{split}_tokens", 0)
            if needed and (tokens - 1) // m.seq_len < 1:
                fail(
                    key(k),
                    paths[k],
                    f"has {tokens} {split} tokens, too few for one sample of model.seq_len + 1 = {m.seq_len + 1}",
                    f"{fix}, or a smaller model.seq_len",
                )
    if d.document_mask:
        _check_document_boundaries(paths, metas, key, cfg.train.eval_interval > 0)
    data_vocab = metas[0].get("vocab_size", 0)
    if data_vocab > m.vocab_size:
        fail(
            "model.vocab_size",
            m.vocab_size,
            f"is smaller than {key(0)}={paths[0]}'s tokenizer ({data_vocab} tokens)",
            f"use model.vocab_size>={data_vocab} or data prepared with a smaller tokenizer",
        )
    if d.weights is None:
        return
    weights = list(d.weights)
    if len(weights) != len(paths):
        fail(
            "data.weights",
            weights,
            f"has {len(weights)} entries for {len(paths)} data.path directories",
            "give one weight per directory of data.path (a list), or data.weights=null",
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        fail(
            "data.weights",
            weights,
            "must all be positive numbers",
            "drop a dataset from data.path instead of giving it weight 0",
        )
    smallest = min(weights) / sum(weights)
    if smallest < 1 / BLEND_BLOCK:
        fail(
            "data.weights",
            weights,
            f"gives a dataset {smallest:.2g} of the blend, under the 1/{BLEND_BLOCK} a blending block can hold",
            f"raise its weight to at least {sum(weights) / BLEND_BLOCK:.3g} or drop it",
        )


def _check_document_boundaries(paths: list[str], metas: list[dict], key, validation: bool) -> None:
    """data.document_mask needs where documents begin: the split's index (<split>.idx.npy, written by
    tools/prepare_data.py) or, for data prepared without one, the eos id in meta.json to find them by."""
    for k, meta in enumerate(metas):
        for split in ("train", "val") if validation else ("train",):
            index = os.path.exists(os.path.join(repo_path(paths[k]), f"{split}.idx.npy"))
            if not index and meta.get("eos_id") is None:
                fail(
                    key(k),
                    paths[k],
                    f"has no {split}.idx.npy and no eos_id in its meta.json, so data.document_mask=true cannot "
                    "tell where its documents begin",
                    "prepare it again with tools/prepare_data.py (it writes both), or set data.document_mask=false",
                )
