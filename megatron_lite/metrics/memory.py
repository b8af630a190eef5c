"""Measured memory: each rank's peak allocated bytes per step, for `mem_peak_gib` and the planner's validation.

On a GPU the caching allocator counts every byte (`torch.cuda.max_memory_allocated`). A CPU has no such
counter, so with `train.track_memory=true` a dispatch mode (`LiveTensorBytes`) sees every tensor that an
operator returns, notes its storage the first time it appears, and drops it when the storage is freed (a
weak reference's callback): the live total is exact for every storage created while it is active, and its
maximum is the peak. It is installed before the model is built, so parameters, gradients, optimizer states,
activations and communication buffers all count; what it cannot see is memory an operator uses inside itself
and frees before returning (a kernel's workspace), and memory that is not a tensor. It costs a Python call
per operator, hence off by default.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Live bytes of every tensor storage created while active, and their peak (since reset_peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}

    def _note(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        elif known == size:
            return
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._note(t.untyped_storage())
        return out

    def reset_peak(self) -> None:
        self.peak = self.live

    def storages(self) -> dict[int, int]:
        """data_ptr -> bytes of every live tracked storage (to tell what the live bytes are made of)."""
        out = {}
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is not None and self._sizes.get(key):
                out[storage.data_ptr()] = self._sizes[key]
        return out


class PeakMemory:
    """This rank's peak allocated bytes since the last `take()`: the CUDA allocator's on a GPU, the live tensor
    bytes of a LiveTensorBytes mode on a CPU when tracking is on, else nothing (take() returns None)."""

    def __init__(self, device: torch.device, track_cpu: bool):
        self.device = device
        self.tracker = LiveTensorBytes() if track_cpu and device.type != "cuda" else None
        if self.tracker is not None:
            self.tracker.__enter__()
        elif device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @property
    def enabled(self) -> bool:
        return self.device.type == "cuda" or self.tracker is not None

    def take(self) -> int | None:
        """Peak bytes since the previous take (or since start), and start the next interval."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        if self.tracker is None:
            return None
        peak = self.tracker.peak
        self.tracker.reset_peak()
        return peak

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None
