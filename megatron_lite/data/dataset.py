"""Prepared token data (tools/prepare_data.py) as fixed-length training windows.

A sample is seq_len + 1 consecutive tokens (inputs and shifted labels) at stride seq_len, crossing document
boundaries (documents are separated by eos), as GPT-2/Megatron pretraining does. With data.document_mask a sample
also carries each token's position in its document (data/documents.py), from the prepared index of document
starts or, for data prepared without one, from the eos tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from megatron_lite.data.documents import positions_from_eos, positions_from_starts


class TokenData:
    """Read-only memmaps of a prepared directory: `train`, `val` (flat token arrays) and `meta`.

    The .bin files hold at least one element (numpy cannot map an empty file), so the arrays are cut to
    the token counts in meta.json; an empty val split comes back as a zero-length array.
    """

    def __init__(self, path: str):
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        dtype = np.dtype(self.meta["dtype"])
        self.train = np.memmap(os.path.join(path, "train.bin"), dtype=dtype, mode="r")[: self.meta["train_tokens"]]
        self.val = np.memmap(os.path.join(path, "val.bin"), dtype=dtype, mode="r")[: self.meta["val_tokens"]]
        self.path = path

    def doc_starts(self, split: str) -> np.ndarray | None:
        """The split's index of document starts (<split>.idx.npy, memory-mapped), None where the data has none."""
        index = os.path.join(self.path, f"{split}.idx.npy")
        return np.load(index, mmap_mode="r") if os.path.exists(index) else None

    def windows(self, split: str, seq_len: int, documents: bool = False) -> WindowDataset:
        """The split's training windows; with `documents`, each with its tokens' positions in their documents
        (validation/data.py has refused data with neither an index nor an eos id)."""
        tokens = self.train if split == "train" else self.val
        if not documents:
            return WindowDataset(tokens, seq_len)
        return WindowDataset(tokens, seq_len, doc_starts=self.doc_starts(split), eos_id=self.meta.get("eos_id"))

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]


class WindowDataset:
    """Sample i = tokens[i*seq_len : i*seq_len + seq_len + 1] as int64, shape (seq_len + 1,); given document
    starts (or an eos id to find them), the pair (tokens, their positions in their documents), both that shape."""

    def __init__(self, tokens: np.ndarray, seq_len: int, doc_starts: np.ndarray | None = None,
                 eos_id: int | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.doc_starts, self.eos_id = doc_starts, eos_id
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"a split of {len(tokens)} tokens makes no sample of model.seq_len + 1 = {seq_len + 1} "
                             "tokens; use more data (for val: a larger --val-fraction in tools/prepare_data.py, "
                             "or train.eval_interval=0) or a smaller model.seq_len")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:  # past the end numpy would return a short window without complaint
            raise IndexError(f"sample {i} out of range for {self.n} samples")
        start = i * self.seq_len
        window = self.tokens[start: start + self.seq_len + 1].astype(np.int64)
        if self.doc_starts is not None:
            return torch.from_numpy(window), torch.from_numpy(positions_from_starts(start, len(window), self.doc_starts))
        if self.eos_id is not None:
            return torch.from_numpy(window), torch.from_numpy(positions_from_eos(window, self.eos_id))
        return torch.from_numpy(window)
