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
    """Read-only memmaps of a prepared directory: `train`, `val` (flat token arrays) and `meta`."""

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
            raise ValueError(f"{len(tokens)} tokens make no sample of seq_len + 1 = {seq_len + 1} tokens; "
                             "use more data or a smaller model.seq_len")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))

    def stack(self, indices) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64."""
        return torch.stack([self[int(i)] for i in indices])
