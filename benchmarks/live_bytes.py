"""`LiveBytes`: the most bytes of CPU tensor storage alive at once while it is entered.

A CPU process has no allocator that keeps a peak (CUDA's `max_memory_allocated`); this tally is one
for the tensors made under it: a `TorchDispatchMode` that counts each new storage an operator
returns and uncounts it when the storage is freed (a weak finalizer); an operator's input written in
place or viewed is no new storage. Storages made before it was entered (parameters, the
optimizer's state) are not counted. It slows every operator a little: a
measuring tool for tests and benchmarks, not for training.

    with LiveBytes() as live:
        model.train_on_batch(x, y)
    live.peak  # bytes
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """The peak (`peak`) and current (`live`) bytes of CPU storage made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._seen and key not in given:  # new: not an input written or viewed
                    self._seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)
