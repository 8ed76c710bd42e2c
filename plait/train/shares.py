"""Each replica reads only its rows of every global batch of a `Dataset` or `DataLoader`.

`fit` on in-memory tensors slices them; on a data set every rank used to load every global batch
and keep its slice, dp times the reading and decoding one process does. Here the global batches
are drawn as indices only -- by a `DataLoader` over the indices, made exactly as
`plait.data.loader_batches` makes the one over the samples, so its seeded generator gives the same
order -- and each replica loads its rows (`plait.data.shard_bounds`) through a loader of its own,
with the user's collate function and workers. A skipped batch (resumed inside an epoch) loads
nothing. The ranks of one replica (its stages, its tp ranks) each read the replica's rows.

Only a map-style data set (`len` and indices) with the default samplers can be split this way;
anything else (an `IterableDataset`, a loader with its own sampler or batch sampler) is read whole
on every rank, as before (`share_batches` returns None).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from plait.data import Share, pair_of, shard_bounds
from plait.errors import ConfigError

__all__ = ["share_batches"]

# the user's loader settings a replica's own loader keeps (prefetch_factor only with workers)
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "persistent_workers")


def share_batches(data: Any, batch_size: int | None, shuffle: bool, seed: int, skip: int, replica: int,
                  dp: int) -> Iterator[Share] | None:
    """The `Share` of replica `replica` (of `dp`) of each global batch of an epoch after the first
    `skip`, in the order `plait.data.loader_batches(data, batch_size, shuffle, seed)` gives the
    whole batches; None where `data` cannot be read by shares."""
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if (not isinstance(data.sampler, (RandomSampler, SequentialSampler)) or not data.batch_size
                or isinstance(dataset, IterableDataset)):
            return None
        shuffle, batch_size, drop_last = isinstance(data.sampler, RandomSampler), data.batch_size, data.drop_last
        kept = {name: getattr(data, name) for name in _KEPT}
        if data.num_workers:
            kept["prefetch_factor"] = data.prefetch_factor
    elif isinstance(data, Dataset) and not isinstance(data, IterableDataset):
        if batch_size is None:
            raise ConfigError("fit(dataset) needs batch_size=...; or pass a DataLoader")
        dataset, drop_last, kept = data, False, {}
    else:
        return None
    indices: DataLoader[Any] = DataLoader(range(len(dataset)), batch_size=batch_size, shuffle=shuffle,  # type: ignore[arg-type]
                         drop_last=drop_last, generator=torch.Generator().manual_seed(seed))
    batches = [index.tolist() for index in itertools.islice(indices, skip, None)]
    mine = [(len(b), *shard_bounds(len(b), dp)[replica]) for b in batches]
    wanted = [b[lo:hi] for b, (_, lo, hi) in zip(batches, mine) if hi > lo]
    return _shares(DataLoader(dataset, batch_sampler=wanted, **kept) if wanted else iter(()), mine)


def _shares(loader: Any, mine: list[tuple[int, int, int]]) -> Iterator[Share]:
    items = iter(loader)
    for rows, lo, hi in mine:
        if hi == lo:  # a batch of fewer rows than replicas: this one has none
            yield Share(None, None, rows, lo)
            continue
        x, y = pair_of(next(items))
        yield Share(x, y, rows, lo)
