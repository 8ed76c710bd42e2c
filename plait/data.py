"""Batches and micro-batches: cutting user data (tensors, tuples, dicts, datasets) the same way on every rank."""

from __future__ import annotations

import hashlib
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler

from plait.errors import ConfigError, PlaitError

__all__ = [
    "Share",
    "global_rows",
    "replica_rows",
    "as_call",
    "num_rows",
    "take",
    "microbatch_bounds",
    "shard_bounds",
    "slice_rows",
    "to_device",
    "index_batches",
    "loader_batches",
    "pair_of",
    "count_batches",
    "row_ranges",
    "data_order",
    "epoch_seed",
    "epoch_batches",
    "join_rows",
]


@dataclass(frozen=True)
class Share:
    """One replica's rows of a global batch, read alone (`plait.train.shares`): `x` and `y` hold
    rows start:start + n of a batch of `rows` rows, n its share (`shard_bounds`; None when 0)."""

    x: Any
    y: Any
    rows: int
    start: int


def global_rows(x: Any) -> int:
    """Rows of the global batch `x` is, or is a replica's share of."""
    return x.rows if isinstance(x, Share) else num_rows(x)


def replica_rows(x: Any, y: Any, start: int, stop: int, whose: str) -> tuple[Any, Any, int]:
    """x and y with rows start:stop of their global batch, and where those begin in them: at
    `start` in a whole batch, at 0 in a `Share` (which must hold exactly those rows)."""
    if not isinstance(x, Share):
        return x, y, start
    held = (x.start, x.start + (0 if x.x is None else num_rows(x.x)))
    if held != (start, stop):
        raise PlaitError(f"a share of rows {held[0]}:{held[1]} of a batch of {x.rows} came to {whose}, whose rows "
                         f"are {start}:{stop}; read each replica's rows with its dp rank (`plait.train.shares`)")
    return x.x, x.y, 0


def as_call(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How `x` is passed to the model: a tensor or tuple positionally, a dict as keywords."""
    if isinstance(x, dict):
        return (), dict(x)
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}


def num_rows(x: Any) -> int:
    """Rows (samples) in `x`: the common size of dim 0 of its tensors."""
    if isinstance(x, torch.Tensor) and x.dim() > 0:  # the common case, without walking a tree
        return int(x.shape[0])
    sizes = {t.shape[0] for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ConfigError(
            f"inputs must hold tensors whose first dimension is the batch, all of one size; got "
            f"first-dimension sizes {sorted(sizes)}"
        )
    return sizes.pop()


def take(x: Any, index: torch.Tensor) -> Any:
    """Rows `index` of every tensor in `x` (other values are kept)."""
    return pytree.tree_map(
        lambda t: t[index] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, x
    )


def to_device(x: Any, device: torch.device) -> Any:
    """`x` with every tensor on `device` (no copy when it is there already)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def slice_rows(x: Any, start: int, stop: int) -> Any:
    """Rows start:stop of every tensor in `x`, without copying."""
    if isinstance(x, torch.Tensor):
        return x[start:stop] if x.dim() > 0 else x
    return pytree.tree_map(
        lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, x
    )


def shard_bounds(rows: int, dp: int) -> list[tuple[int, int]]:
    """Row ranges of each data-parallel replica's share of a global batch.

    Contiguous, in replica order, sizes differ by at most one (larger first); when the batch has
    fewer rows than replicas, the last replicas get none. Every row goes to exactly one replica.
    """
    base, extra = divmod(rows, dp)
    bounds, start = [], 0
    for r in range(dp):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def microbatch_bounds(rows: int, num_microbatches: int) -> list[tuple[int, int]]:
    """Row ranges of the micro-batches: sizes differ by at most one, the larger ones first.

    More micro-batches than rows are clamped to one row each, with a warning.
    """
    if num_microbatches > rows:
        warnings.warn(
            f"num_microbatches={num_microbatches} is more than the {rows} rows of this batch; "
            f"using {rows} micro-batches of one row",
            stacklevel=3,
        )
        num_microbatches = rows
    return shard_bounds(rows, num_microbatches)


def index_batches(rows: int, batch_size: int, shuffle: bool, seed: int) -> list[torch.Tensor]:
    """Row indices of each global batch; the shuffle order depends only on `seed`."""
    if shuffle:
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(rows)
    return list(torch.split(order, batch_size))


def loader_batches(data: Dataset[Any] | DataLoader[Any], batch_size: int | None, shuffle: bool,
                   seed: int) -> Iterator[tuple[Any, Any]]:
    """(x, y) global batches of a Dataset or DataLoader, in an order every rank agrees on.

    A DataLoader with a random or sequential sampler is rebuilt with a seeded generator, so
    ranks that each made their own loader still see identical batches.
    """
    if isinstance(data, DataLoader):
        loader = data
        if isinstance(loader.sampler, (RandomSampler, SequentialSampler)) and loader.batch_size:
            loader = DataLoader(
                loader.dataset,
                batch_size=loader.batch_size,
                shuffle=isinstance(loader.sampler, RandomSampler),
                collate_fn=loader.collate_fn,
                drop_last=loader.drop_last,
                generator=torch.Generator().manual_seed(seed),
            )
    else:
        if batch_size is None:
            raise ConfigError("fit(dataset) needs batch_size=...; or pass a DataLoader")
        loader = DataLoader(
            data, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
        )
    for item in loader:
        yield pair_of(item)


def pair_of(item: Any) -> tuple[Any, Any]:
    """(input, target) of a loader's batch; ConfigError naming what it is otherwise."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ConfigError(
            f"each item of the dataset must be an (input, target) pair, got "
            f"{type(item).__name__}{'' if not isinstance(item, (tuple, list)) else f' of {len(item)}'}"
        )
    return item[0], item[1]


def count_batches(x: Any, batch_size: int | None) -> int:
    """Global batches in one epoch of `x` (tensors, a Dataset or a DataLoader); checks batch_size."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive integer, or None for the whole set in one batch; "
                          f"got {batch_size!r}")
    if isinstance(x, DataLoader):
        return len(x)
    if isinstance(x, Dataset):
        if batch_size is None:
            raise ConfigError("fit(dataset) needs batch_size=...")
        return -(-len(x) // batch_size)  # type: ignore[arg-type]
    rows = num_rows(x)
    if rows == 0:
        raise ConfigError("x has 0 rows; give at least one sample")
    return -(-rows // (batch_size or rows))


def batch_sizes(x: Any, batch_size: int | None) -> tuple[int, ...]:
    """The sizes of an epoch's global batches, the full one first and a smaller last one if any; ()
    where the data does not tell before it is read (a DataLoader with its own sampler)."""
    if isinstance(x, DataLoader):
        if not isinstance(x.sampler, (RandomSampler, SequentialSampler)) or not x.batch_size:
            return ()
        rows, batch_size = len(x.dataset), x.batch_size  # type: ignore[arg-type]
        if x.drop_last:
            return (batch_size,) if rows >= batch_size else ()
    else:
        rows = len(x) if isinstance(x, Dataset) else num_rows(x)  # type: ignore[arg-type]
        batch_size = batch_size or rows
    last = rows % batch_size
    return (min(batch_size, rows),) + ((last,) if last and rows > batch_size else ())


def row_ranges(x: Any, batch_size: int | None) -> list[tuple[int, int]]:
    """(start, stop) rows of each batch of `x` in order, for evaluate and predict; checks batch_size."""
    count_batches(x, batch_size)
    rows = num_rows(x)
    return [(int(i[0]), int(i[-1]) + 1) for i in index_batches(rows, batch_size or rows, False, 0)]


def data_order(x: Any, y: Any, batch_size: int | None, shuffle: bool, batches_per_epoch: int,
               seed: int) -> dict[str, Any]:
    """What fixes the batches and their order: a resumed fit must be given the same."""
    rows = None if isinstance(x, (Dataset, DataLoader)) else num_rows(x)
    return {"seed": seed, "shuffle": bool(shuffle), "batch_size": batch_size,
            "rows": rows, "batches_per_epoch": batches_per_epoch, "data_fingerprint": fingerprint(x, y)}


FINGERPRINT_ROWS = 64  # rows hashed, evenly spaced: cheap on any data set, and any edit of them shows


def fingerprint(x: Any, y: Any) -> str | None:
    """A short hash of in-memory data (shapes, dtypes and up to FINGERPRINT_ROWS evenly spaced rows
    of every tensor of x and y); None for a Dataset or DataLoader (it is not read twice)."""
    if isinstance(x, (Dataset, DataLoader)):
        return None
    rows = num_rows(x)
    count = min(rows, FINGERPRINT_ROWS)
    index = torch.tensor(sorted({round(i * (rows - 1) / max(count - 1, 1)) for i in range(count)}), dtype=torch.long)
    leaves, spec = pytree.tree_flatten((x, y))
    digest = hashlib.sha256(str(spec).encode())  # the structure (dict keys, tuple lengths) counts
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            digest.update(f"{tuple(leaf.shape)} {leaf.dtype}".encode())
            sample = leaf.detach()[index.to(leaf.device)] if leaf.dim() > 0 else leaf.detach()
            digest.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()[:16]


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's order: `seed` (Config.seed) and the epoch only."""
    return seed * 1_000_003 + epoch


def epoch_batches(x: Any, y: Any, batch_size: int | None, shuffle: bool, seed: int, epoch: int,
                  skip: int = 0) -> Iterator[tuple[Any, Any]]:
    """The (x, y) global batches of one epoch after the first `skip`; the order follows
    `seed` and `epoch` only."""
    seed = epoch_seed(seed, epoch)
    if isinstance(x, (Dataset, DataLoader)):
        yield from itertools.islice(loader_batches(x, batch_size, shuffle, seed), skip, None)
        return
    if y is None:
        raise ConfigError("fit(x, y): targets y are missing")
    rows = num_rows(x)
    if num_rows(y) != rows:
        raise ConfigError(f"x has {rows} rows but y has {num_rows(y)}; give one target per row")
    for index in index_batches(rows, batch_size or rows, shuffle, seed)[skip:]:
        if shuffle:
            yield take(x, index), take(y, index)
        else:
            yield slice_rows(x, int(index[0]), int(index[-1]) + 1), slice_rows(y, int(index[0]), int(index[-1]) + 1)


def join_rows(flats: list[list[Any]]) -> list[Any]:
    """Join lists of output leaves along the batch dimension (other leaves: the first one)."""
    return [
        torch.cat([f[i] for f in flats])
        if isinstance(flats[0][i], torch.Tensor) and flats[0][i].dim() > 0 else flats[0][i]
        for i in range(len(flats[0]))
    ]
