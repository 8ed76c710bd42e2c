"""Reading named weights from safetensors files and Hugging Face sharded directories, only the names asked for.

    weights.safetensors                 one file (`safetensors.torch.save_file`, `plait export`)
    directory/model.safetensors         what `save_pretrained` writes for a small model
    directory/model.safetensors.index.json   ... and for a large one (`max_shard_size=`):
        {"metadata": {...}, "weight_map": {"model.norm.weight": "model-00002-of-00006.safetensors", ...}}
    directory/model-0000K-of-0000N.safetensors

A rank asks for the names its stages use: only the files holding them are opened, and from each
only those tensors are read (safetensors reads a tensor at its offset; the rest of the file is
never touched). Every name and shape is checked against the headers before any value is copied,
so weights that do not fit leave the model as it was. A tied tensor (one tensor under several
names of `net.state_dict()`) needs only one of its names in the file: `save_pretrained` writes
it once (`lm_head.weight` is absent when tied to the embedding).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping

import torch

from plait.checkpoint import disk, tensorfile
from plait.errors import CheckpointError
from plait.tensor_parts import RowSpan, as_held, whole_shape

__all__ = ["INDEX", "SINGLE", "Loaded", "Rows", "holds_weights", "weight_map", "load_weights"]

Rows = tuple[torch.Tensor, RowSpan]  # the tensor holding a replica's rows of a weight, the whole's rows to read

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_INDEX = 64 * 2**20
_SHOWN = 10  # names listed in an error before "... (N more)"


@dataclass(frozen=True)
class Loaded:
    """What `load_weights` did: the file's names it read and the files it opened (in the order
    of the state dict), and the file's names the model does not have (not read)."""

    read: list[str]
    files: list[str]
    ignored: list[str]


def holds_weights(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is what `load_weights` reads: a `.safetensors` file, or a directory holding
    INDEX or SINGLE that is not a plait checkpoint directory (plait's own layout comes first)."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".safetensors"
    if not path.is_dir() or disk.is_checkpoint_dir(path):
        return False
    return (path / INDEX).is_file() or (path / SINGLE).is_file()


def weight_map(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Name -> the file holding it, of a weights file or directory (only the index or one header is read)."""
    path = Path(path)
    if path.is_file():
        with _opened(path) as f:
            return dict.fromkeys(f.names(), path)
    if (path / INDEX).is_file():
        return _read_index(path / INDEX)
    if (path / SINGLE).is_file():
        return weight_map(path / SINGLE)
    raise CheckpointError(f"{path}: neither a .safetensors file nor a directory holding {INDEX} or {SINGLE} "
                          f"(what save_pretrained writes); pass one of those")


def _read_index(index: Path) -> dict[str, Path]:
    try:
        with open(index, "rb") as f:
            raw = f.read(_MAX_INDEX + 1)
        parsed = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_INDEX else None
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{index}: not JSON ({type(e).__name__}: {e}); the file is damaged") from None
    found = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise CheckpointError(f"{index}: no \"weight_map\" object of name -> file name; not a Hugging Face "
                              f"index (at most {_MAX_INDEX} bytes)")
    outside = sorted({v for v in found.values() if Path(v).name != v or v in ("", ".", "..")})
    if outside:
        raise CheckpointError(f"{index}: names files outside its directory: {outside[:3]}; the index must "
                              f"name the shard files beside it")
    lost = sorted({v for v in found.values() if not (index.parent / v).is_file()})
    if lost:
        raise CheckpointError(f"{index.parent}: the index names {len(lost)} shard files that are not there: "
                              f"{_listed(lost)}; download or copy the whole directory")
    return {name: index.parent / file for name, file in found.items()}


class _File:
    """One open safetensors file: its names and shapes from the header, a tensor read by name.

    Through the `safetensors` package (a tensor at a time, at its offset); without it, plait's
    own reader (tensorfile), which reads the whole file.
    """

    def __init__(self, path: Path, handle: Any, tensors: dict[str, torch.Tensor] | None) -> None:
        self.path, self.handle, self.tensors = path, handle, tensors

    def names(self) -> list[str]:
        return list(self.tensors) if self.tensors is not None else list(self.handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if self.tensors is not None:
            return tuple(self.tensors[name].shape)
        return tuple(self.handle.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name] if self.tensors is not None else self.handle.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop (dim 0) of a tensor, read alone where the package can slice the file."""
        if self.tensors is not None:
            return self.tensors[name][start:stop]
        part: torch.Tensor = self.handle.get_slice(name)[start:stop]
        return part


def _safe_open() -> Any:
    """`safetensors.safe_open`, looked up at each call; None without the package (plait does not
    need it; the dev extra's transformers brings it)."""
    try:
        import safetensors
    except ImportError:
        return None
    return safetensors.safe_open


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[_File]:
    """`path` open for reading by name, closed on leaving."""
    safe_open = _safe_open()
    if safe_open is None:
        yield _File(path, None, tensorfile.read_tensors(path)[0])
        return
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - the package's own error types: one clear error
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    with handle:
        yield _File(path, handle, None)


def load_weights(path: str | os.PathLike[str], state: Mapping[str, torch.Tensor],
                 wanted: Collection[str] | None = None, rows: Mapping[int, Rows] | None = None) -> Loaded:
    """Copy the weights at `path` into the tensors of `state` named in `wanted` (default: all).

    `state` is the model's `net.state_dict(keep_vars=True)`: names of one tensor are aliases, and
    the file needs one of them. Dtypes are converted. CheckpointError, before anything is copied,
    lists the wanted names the file lacks and the shapes that differ. `rows` (zero=3: id of a
    tensor of `state` -> the tensor holding this replica's rows of it, and the rows of the whole to
    read for them, `RowSpan`): only those rows are read, into it.
    """
    files = weight_map(path)
    want = set(state) if wanted is None else set(wanted)
    assert want <= set(state), sorted(want - set(state))[:3]
    aliases: dict[int, list[str]] = defaultdict(list)  # id(tensor) -> its names, in state order
    for name, t in state.items():
        aliases[id(t)].append(name)
    source: dict[str, str] = {}  # the tensor's first name -> the name it is read under
    missing = []
    for names in aliases.values():
        if want.intersection(names):
            found = next((n for n in names if n in files), None)
            if found is None:
                missing.append(names[0])
            else:
                source[names[0]] = found
    ignored = [n for n in files if n not in state]
    by_file: dict[Path, list[str]] = defaultdict(list)
    for first in source:
        by_file[files[source[first]]].append(first)
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(_opened(file)) for file in by_file}
        _check(path, state, source, missing, ignored, {opened[file]: firsts for file, firsts in by_file.items()},
               files)
        with torch.no_grad():
            for file, firsts in by_file.items():
                for first in firsts:
                    own = (rows or {}).get(id(state[first]))
                    if own is not None:  # this replica's rows alone (of its tp part)
                        local, span = own
                        local.copy_(span.kept(opened[file].rows(source[first], span.start, span.stop)))
                    else:
                        state[first].copy_(as_held(state[first], opened[file].tensor(source[first])))
    order = {name: i for i, name in enumerate(files)}
    return Loaded(sorted(source.values(), key=order.__getitem__), [str(f) for f in by_file], ignored)


def _check(path: str | os.PathLike[str], state: Mapping[str, torch.Tensor], source: Mapping[str, str],
           missing: list[str], ignored: list[str], opened: Mapping[_File, list[str]], files: Collection[str]) -> None:
    """CheckpointError naming every wanted name the file lacks and every shape that differs, if any.

    `opened` maps each open file to the first names of the tensors read from it (`source`: under which name).
    """
    shapes, lost = [], []
    for f, firsts in opened.items():
        present = set(f.names())
        for first in firsts:
            name = source[first]
            if name not in present:
                lost.append(f"{name} (in {f.path.name})")
            elif f.shape(name) != whole_shape(state[first]):
                shapes.append(f"{name}: file {list(f.shape(name))}, model {list(whole_shape(state[first]))}")
    parts = []
    if missing:
        parts.append(f"it lacks {len(missing)} of the {len(missing) + len(source)} tensors to load: "
                     f"{_listed(missing)} (the file has {len(files)}, e.g. {', '.join(list(files)[:3])})")
        hint = _prefix_hint(missing, files)
        if hint:
            parts.append(hint)
        elif not source and ignored:
            parts.append(f"none of the model's names is in it, and it has {len(ignored)} the model does not: "
                         f"{_listed(ignored)}")
    if lost:
        parts.append(f"the index places {len(lost)} names in files that lack them: {_listed(lost)}")
    if shapes:
        parts.append(f"{len(shapes)} shapes differ: {_listed(shapes)}")
    if parts:
        raise CheckpointError(f"{path} does not fit the model: " + "; ".join(parts) + ". Load the weights "
                              "saved from this architecture and size (the names of net.state_dict())")


def _prefix_hint(missing: list[str], files: Collection[str]) -> str:
    """How a prefix on one side would make the names match ("model." on the file's or the model's), or ''."""
    for m in missing[:20]:
        parts = m.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i]) + "."
            if m[len(prefix):] in files:
                n = sum(x.startswith(prefix) and x[len(prefix):] in files for x in missing)
                return (f"the model's names start with {prefix!r} where the file's do not ({m!r} is "
                        f"{m[len(prefix):]!r} there; {n} of the {len(missing)} would match without it): the "
                        f"model wraps the one that was saved; load the weights into the inner module, or "
                        f"save them from the wrapper")
        for f in files:
            if f.endswith("." + m):
                prefix = f[: -len(m)]
                n = sum(prefix + x in files for x in missing)
                return (f"the file's names start with {prefix!r} where the model's do not ({m!r} is {f!r} "
                        f"there; {n} of the {len(missing)} would match with it): the file was saved from a "
                        f"module wrapping this one; save the inner module's weights, or wrap this one alike")
    return ""


def _listed(items: list[str], shown: int = _SHOWN) -> str:
    return ", ".join(items[:shown]) + (f", ... ({len(items) - shown} more)" if len(items) > shown else "")
