"""A rank's training state by name: the model tensors it owns, their optimizer state, its RNG states.

Everything is keyed by the names of `net.state_dict()`, never by rank or stage, so a checkpoint
saved by one layout loads into any other: a rank takes the names it needs from whichever shard
holds them. Inside a shard:

    "0.weight"                       a model tensor, saved once by the rank that trains it, or
                                     this rank's part of one split over a tp group (each part
                                     under the full name; meta.json's index has the whole shape
                                     and the split: {"dim", "blocks", "shards": rank of each part})
    "optimizer/0.weight/exp_avg"     a tensor of that parameter's optimizer state
    "rng/torch", "rng/cuda/0"        this rank's torch generator states
    __metadata__["plait"] (JSON)     non-tensor optimizer state, each param group's settings
                                     and parameter names, Python's and NumPy's RNG states
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch
from torch import nn

from plait.checkpoint.disk import Checkpoint
from plait.checkpoint.parts import holders, join_rows, join_state, shard_reads
from plait.errors import CheckpointError
from plait.tensor_parts import RowSpan, as_held, whole_shape


__all__ = ["Snapshot", "snapshot", "restore", "model_index", "owned_tensors",
           "optimizer_state", "restore_optimizer", "rng_state", "restore_rng", "copy_into", "check_names"]

log = logging.getLogger("plait")

_OPT, _RNG = "optimizer/", "rng/"
Split = tuple[int, int, Sequence[int]]  # a tp-split tensor: dim, blocks, the rank of each part


class RowShards(Protocol):
    """zero=3's sharded parameters (`plait.runtime.dp.sharded_params.ShardedParameters`): each
    user's parameter with this rank's shard of it, its rows of a sharded tensor, and a whole value
    as a shard holds it."""

    pairs: list[tuple[nn.Parameter, nn.Parameter]]

    def rows(self, t: torch.Tensor) -> torch.Tensor: ...

    def held(self, shard: torch.Tensor, whole: torch.Tensor, span: RowSpan | None = None) -> torch.Tensor: ...

    def rows_of(self, shard: torch.Tensor) -> RowSpan | None: ...


_SIMPLE = (bool, int, float, str, type(None))


def model_index(net: nn.Module, owner_of: Mapping[int, int], parts: Mapping[int, Split] | None = None,
                ) -> tuple[list[str], dict[str, str], dict[str, dict[str, Any]]]:
    """(state_dict names in order, alias -> first name of a shared tensor, first name -> entry).

    An entry is {"shard": the rank that saves it, "shape", "dtype"}; tensors no stage uses
    are saved by rank 0, as `gather_state_dict` takes them from there. A tensor split over a tp
    group (`parts`: id -> (dim, blocks, rank of each part)) has its whole shape, and "split":
    {"dim", "blocks", "shards"}; "shard" is its first part's rank.
    """
    keys: list[str] = []
    aliases: dict[str, str] = {}
    entries: dict[str, dict[str, Any]] = {}
    first: dict[int, str] = {}
    for name, t in net.state_dict(keep_vars=True).items():
        keys.append(name)
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        entry: dict[str, Any] = {"shard": owner_of.get(id(t), 0), "shape": list(whole_shape(t)), "dtype": str(t.dtype)}
        split = (parts or {}).get(id(t))
        if split is not None:
            dim, blocks, ranks = split
            entry.update(shard=ranks[0], split={"dim": dim, "blocks": blocks, "shards": list(ranks)})
        entries[name] = entry
    return keys, aliases, entries


def owned_tensors(net: nn.Module, entries: Mapping[str, Mapping[str, Any]], rank: int,
                  sharded: RowShards | None = None) -> dict[str, torch.Tensor]:
    """The model tensors this rank saves (its part of a split one; zero=3: its shard's rows), by
    their first name."""
    state = net.state_dict(keep_vars=True)
    rows = {id(whole): sharded.rows(shard) for whole, shard in sharded.pairs} if sharded is not None else {}
    return {name: rows.get(id(state[name]), state[name]).detach() for name, e in entries.items() if rank in holders(e)}


def _names(net: nn.Module, sharded: RowShards | None = None) -> dict[int, str]:
    """id(tensor) -> its first state_dict name (zero=3: a shard named as the parameter it is of)."""
    out: dict[int, str] = {}
    for name, t in net.state_dict(keep_vars=True).items():
        out.setdefault(id(t), name)
    for whole, shard in sharded.pairs if sharded is not None else ():
        if id(whole) in out:
            out[id(shard)] = out[id(whole)]
    return out


def _plain(value: Any, where: str) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
        return list(value)
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; plait saves optimizer settings and state made of "
        f"tensors, numbers, strings and None (optimizers such as LBFGS that keep lists of tensors "
        f"are not supported)"
    )


def optimizer_state(optimizer: torch.optim.Optimizer | None, net: nn.Module, owned: Iterable[str],
                    sharded: RowShards | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of the optimizer state of the parameters named in `owned`, by name (zero=3:
    a shard's state, its rows)."""
    if optimizer is None:
        return {}, {"class": None, "groups": [], "state": {}}
    names, keep = _names(net, sharded), set(owned)
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: _plain(v, f"param group setting {k!r}") for k, v in group.items()
                    if k != "params" and not isinstance(v, torch.Tensor)}
        settings.update({k: v.item() for k, v in group.items() if isinstance(v, torch.Tensor) and v.numel() == 1})
        groups.append({"settings": settings, "params": [names.get(id(p), "") for p in group["params"]]})
    for param, state in optimizer.state.items():
        name = names.get(id(param))
        if name is None or name not in keep:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPT}{name}/{key}"] = (sharded.rows(value) if sharded is not None else value).detach()
            else:
                values.setdefault(name, {})[key] = _plain(value, f"optimizer state {key!r} of {name!r}")
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return tensors, {"class": kind, "groups": groups, "state": values}


def restore_optimizer(optimizer: torch.optim.Optimizer, net: nn.Module, params: Iterable[nn.Parameter],
                      shards: Mapping[int, tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]],
                      entries: Mapping[str, Mapping[str, Any]] | None = None, sharded: RowShards | None = None,
                      rows: Mapping[str, RowSpan] | None = None) -> int:
    """Set the state of `params` (this rank's) from the shards that hold it; return how many got one.

    `shards` maps a rank to its (tensors, JSON optimizer part). Each parameter's group settings
    come from the group that held it when saved, so a new layout keeps changed learning rates.
    The state of a parameter saved split over tp ranks (`entries`: the checkpoint's index) is
    joined from its parts, and cut to this rank's part where the parameter is split here (zero=3:
    `sharded`, its rows of each). `rows` (parameter name -> the rows of the whole read): the shards
    hold only those rows of that parameter's state (`restore`), which this rank's shard keeps as the
    `RowSpan` says.
    """
    try:
        return _restore_optimizer(optimizer, net, params, shards, entries or {}, sharded, rows or {})
    except (TypeError, ValueError, AttributeError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's optimizer state is malformed or does not fit this "
                              f"optimizer ({type(e).__name__}: {e})") from None


def _restore_optimizer(optimizer: torch.optim.Optimizer, net: nn.Module, params: Iterable[nn.Parameter],
                       shards: Mapping[int, tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]],
                       entries: Mapping[str, Mapping[str, Any]], sharded: RowShards | None,
                       rows: Mapping[str, RowSpan]) -> int:
    names = _names(net, sharded)
    found: dict[str, dict[str, Any]] = {}
    pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (name, field) -> rank -> its tensor
    settings: dict[str, dict[str, Any]] = {}
    kinds = {part.get("class") for _, part in shards.values()} - {None}
    mine = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if kinds and kinds != {mine}:
        log.warning("plait: the checkpoint's optimizer is %s, this one is %s: optimizer state not restored",
                    sorted(str(k) for k in kinds), mine)
        return 0
    for rank, (tensors, part) in shards.items():
        for key, t in tensors.items():
            if key.startswith(_OPT):
                name, _, field = key[len(_OPT):].rpartition("/")
                pieces.setdefault((name, field), {})[rank] = t
                found.setdefault(name, {})[field] = t
        for name, values in part.get("state", {}).items():
            found.setdefault(name, {}).update(values)
        for group in part.get("groups", []):
            for name in group.get("params", []):
                settings.setdefault(name, group.get("settings", {}))
    wanted = {id(p) for p in params}
    restored: dict[nn.Parameter, dict[str, Any]] = {}
    for (name, field), values in pieces.items():
        span = rows.get(name) if next(iter(values.values())).dim() else None  # (a step count: whole)
        found[name][field] = (join_state(entries.get(name, {}), values) if span is None
                              else join_rows(entries.get(name, {}), values, (span.start, span.stop)))
    for group in optimizer.param_groups:
        group_names = [names.get(id(p), "") for p in group["params"]]
        saved = next((settings[n] for n in group_names if n in settings), None)
        for key, value in (saved or {}).items():
            if key in group and not isinstance(group[key], torch.Tensor):
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
            elif key in group:
                group[key].fill_(value)
        for p, name in zip(group["params"], group_names):
            if id(p) in wanted and name in found:
                state = {k: _held(p, v, sharded, rows.get(name)).to(p.device) if isinstance(v, torch.Tensor) else v
                         for k, v in found[name].items()}
                _check_like(name, state, optimizer.state.get(p) or next(iter(restored.values()), None))
                restored[p] = state
    for p, state in restored.items():
        optimizer.state[p] = state
    return len(restored)


def _held(p: torch.Tensor, value: torch.Tensor, sharded: RowShards | None, span: RowSpan | None = None) -> torch.Tensor:
    """A whole `value` as parameter `p` holds it: zero=3's rows of it (`sharded`; with `span`, `value`
    is the rows it names), the part where tp cut `p` (`as_held`); a value of another shape (a step
    count) as it is."""
    return sharded.held(p, value, span) if sharded is not None else as_held(p, value)


def _check_like(name: str, state: dict[str, Any], like: dict[str, Any] | None) -> None:
    """A parameter's restored state has the keys, kinds and shapes of the state it replaces.

    (Or, for a fresh optimizer, the keys and kinds of the other parameters' restored states.)
    """
    if not like:
        return
    if set(state) != set(like):
        raise CheckpointError(f"the optimizer state of {name!r} holds {sorted(state)}, this optimizer "
                              f"keeps {sorted(like)}")
    for key, value in state.items():
        old = like[key]
        if isinstance(old, torch.Tensor) != isinstance(value, torch.Tensor) or (
                isinstance(old, torch.Tensor) and (old.dim() == 0) != (value.dim() == 0)):
            raise CheckpointError(f"the optimizer state {key!r} of {name!r} is {value!r:.60}, this "
                                  f"optimizer keeps {old!r:.60}")


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of this process's torch (CPU, CUDA), Python and NumPy generators."""
    tensors = {f"{_RNG}torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_RNG}cuda/{i}"] = state
    version, words, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(words), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return tensors, out


def restore_rng(tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> None:
    """Set this process's generators to a `rng_state()` taken earlier."""
    try:
        if f"{_RNG}torch" in tensors:
            torch.set_rng_state(tensors[f"{_RNG}torch"])
        cuda = sorted((int(k.rsplit("/", 1)[1]), t) for k, t in tensors.items() if k.startswith(f"{_RNG}cuda/"))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t for _, t in cuda][: torch.cuda.device_count()])
        if "python" in state:
            version, words, gauss = state["python"]
            random.setstate((version, tuple(words), gauss))
        if "numpy" in state:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (TypeError, ValueError, RuntimeError, OverflowError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"the checkpoint's RNG state is malformed ({type(e).__name__}: {e})") from None


def check_names(expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]], where: str) -> None:
    """CheckpointError listing missing and unexpected names and shape mismatches, if any."""
    missing = [n for n in expected if n not in got]
    unexpected = [n for n in got if n not in expected]
    shapes = [f"{n}: model {list(expected[n])}, saved {list(got[n])}"
              for n in expected if n in got and tuple(expected[n]) != tuple(got[n])]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (("missing from " + where, missing), ("unexpected in " + where, unexpected),
                         ("shape mismatch", shapes)):
        if items:
            shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
            parts.append(f"{label} ({len(items)}): {shown}")
    raise CheckpointError(
        f"{where} does not fit the model: " + "; ".join(parts)
        + ". Load it into the model it was saved from (the same architecture and sizes)"
    )


def copy_into(net: nn.Module, values: Mapping[str, torch.Tensor], aliases: Mapping[str, str], where: str,
              shapes: Mapping[str, Sequence[int]] | None = None,
              rows: Mapping[int, tuple[torch.Tensor, RowSpan]] | None = None) -> None:
    """Copy `values` (names of net.state_dict(), shared tensors once or under every name) into `net`.

    With `shapes` (every saved tensor's shape by name: a checkpoint's index), `values` need hold
    only the tensors this rank has (not on meta): the names are checked against `shapes`. `rows`
    (zero=3: id of a tensor of net.state_dict() -> the tensor holding a replica's rows of it): the
    value of such a tensor is the whole's rows its `RowSpan` names, kept as it says in that tensor."""
    state = net.state_dict(keep_vars=True)
    check_saved(net, {n: tuple(v.shape) for n, v in values.items()} if shapes is None else shapes, aliases, where)
    with torch.no_grad():
        for name, t in state.items():
            if shapes is not None and t.is_meta:
                continue  # another rank's tensor
            value = values.get(name, values.get(aliases.get(name, name)))
            assert value is not None, name
            own = (rows or {}).get(id(t))
            if own is not None:
                own[0].copy_(own[1].kept(value))
            else:
                t.copy_(as_held(t, value))


def check_saved(net: nn.Module, shapes: Mapping[str, Sequence[int]], aliases: Mapping[str, str], where: str) -> None:
    """CheckpointError unless the saved tensors (`shapes` by name; shared ones once, see `aliases`)
    are net.state_dict()'s, by name and shape."""
    saved = {n: tuple(shape) for n, shape in shapes.items()}
    state = net.state_dict(keep_vars=True)
    expected = {n: whole_shape(t) for n, t in state.items()}
    got = {n: shape for n in state if (shape := saved.get(n, saved.get(aliases.get(n, n)))) is not None}
    got.update({n: shape for n, shape in saved.items() if n not in state})
    check_names(expected, got, where)


@dataclass(frozen=True)
class Snapshot:
    """One rank's shard (tensors, __metadata__) and the model's index for meta.json."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    index: dict[str, Any]  # state_keys, aliases, tensors: the same on every rank


def snapshot(net: nn.Module, owner_of: Mapping[int, int], rank: int,
             optimizer: torch.optim.Optimizer | None, parts: Mapping[int, Split] | None = None,
             sharded: RowShards | None = None) -> Snapshot:
    """What rank `rank` saves: the model tensors it owns (its parts of tp-split ones and, zero=3,
    the rows of its `sharded` ones: `parts` says which), their optimizer state, its RNG states."""
    keys, aliases, entries = model_index(net, owner_of, parts)
    tensors = owned_tensors(net, entries, rank, sharded)
    opt_tensors, opt_json = optimizer_state(optimizer, net, list(tensors), sharded)
    rng_tensors, rng_json = rng_state()
    metadata = {"plait": json.dumps({"rank": rank, "optimizer": opt_json, "rng": rng_json})}
    return Snapshot({**tensors, **opt_tensors, **rng_tensors}, metadata,
                    {"state_keys": keys, "aliases": aliases, "tensors": entries})


def restore(ckpt: Checkpoint, net: nn.Module, optimizer: torch.optim.Optimizer | None,
            local: Iterable[nn.Parameter], rank: int, same_layout: bool, sharded: RowShards | None = None) -> None:
    """The optimizer state of this rank's parameters (from whichever shards hold it; zero=3: of its
    `sharded` ones, their rows) and, when the layout is the one that saved it, this rank's RNG states.
    Each shard is read for what this rank takes of it: its parameters' optimizer state (zero=3: only
    the rows this replica keeps, `RowShards.rows_of`) and its own RNG state."""
    local = list(local)
    entries = ckpt.meta["tensors"]
    names = _names(net, sharded)
    rows = {names[id(p)]: own for p in local if sharded is not None and id(p) in names
            and (own := sharded.rows_of(p)) is not None}
    mine = [names[id(p)] for p in local if names.get(id(p)) in entries]
    wanted = shard_reads(entries, mine, {name: (span.start, span.stop) for name, span in rows.items()})

    def select(holder: int) -> Callable[[str], tuple[int, int] | bool]:
        def pick(key: str) -> tuple[int, int] | bool:
            if key.startswith(_RNG):
                return holder == rank and same_layout
            return key.startswith(_OPT) and wanted.get(holder, {}).get(key[len(_OPT):].rpartition("/")[0], False)
        return pick

    shards = {r: ckpt.read_shard(r, select(r)) for r in sorted(set(wanted) | ({rank} if same_layout else set()))}
    if optimizer is not None:
        restore_optimizer(optimizer, net, local, {r: (t, saved.get("optimizer", {})) for r, (t, saved) in shards.items()},
                          entries, sharded, rows)
    if same_layout:
        tensors, part = shards[rank]
        restore_rng(tensors, part.get("rng", {}))
