"""Prepared token data (tools/prepare_data.py) as fixed-length training windows.

A sample is seq_len + 1 consecutive tokens (inputs and shifted labels) at stride seq_len, crossing document
boundaries (documents are separated by eos), as GPT-2/Megatron pretraining does. Left out on purpose:
per-document attention masking and packing-aware position resets.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch


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

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]


class WindowDataset:
    """Sample i = tokens[i*seq_len : i*seq_len + seq_len + 1] as int64, shape (seq_len + 1,)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
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
        return torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))
