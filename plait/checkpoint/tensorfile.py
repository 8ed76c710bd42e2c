"""Named tensors in a file of the safetensors format, written and read without pickle.

    u64 little-endian N | N bytes of JSON header (space-padded to 8) | raw little-endian data
    header: {"name": {"dtype": "F32", "shape": [16, 8], "data_offsets": [begin, end]}, ...,
             "__metadata__": {"key": "text", ...}}          offsets count from the data's start

The same bytes the `safetensors` package writes and reads (tests check both ways), but read
here by plain code that checks every field before it touches the data, so a truncated,
corrupted or hostile file raises `CheckpointError` and never builds anything but tensors.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sys
from typing import Any, BinaryIO, Callable, Mapping

import torch

from plait.errors import CheckpointError

__all__ = ["write_tensors", "read_tensors", "read_header", "DTYPES", "Select"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors package's own limit
_MAX_DIM = 2**62


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order (this machine is little-endian, see below)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def write_tensors(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """Write `tensors` (distinct names, no shared storage needed) and `metadata`; return the sha256."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch supports today
        raise CheckpointError("plait writes checkpoints on little-endian machines only")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {t.dtype}, which plait cannot save; supported: "
                f"{sorted(str(d) for d in _CODES)}"
            )
        blob = _raw(t)
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    for chunk in (struct.pack("<Q", len(text)), text, *blobs):
        f.write(chunk)
        digest.update(chunk)
    return digest.hexdigest()


def read_header(data: bytes | bytearray | memoryview, where: str,
                file_size: int | None = None) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """(entries by name, metadata, start of the data) of a tensor file's bytes, every field checked.
    `data`: the whole file, or (with `file_size`, the file's length) its first bytes up to the data."""
    total_size = len(data) if file_size is None else file_size
    if total_size < 8 or len(data) < 8:
        raise CheckpointError(f"{where}: {total_size} bytes, too short for a tensor file (truncated?)")
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > min(_MAX_HEADER, total_size - 8, len(data) - 8):
        raise CheckpointError(
            f"{where}: the header says it is {size} bytes but the file has {total_size} "
            f"(truncated or not a tensor file)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + size]).decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: the header is not JSON ({type(e).__name__}: {e}); the file is damaged") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: the header is a {type(header).__name__}, not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where}: __metadata__ must map names to strings")
    start, total = 8 + size, total_size - 8 - size
    entries, spans = {}, []
    for name, entry in header.items():
        entries[name] = _check_entry(name, entry, total, where)
        spans.append(tuple(entry["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{where}: tensor data overlaps or leaves a gap at byte {end}")
        end = stop
    if end != total:
        raise CheckpointError(f"{where}: {total} bytes of data, the header accounts for {end} (truncated?)")
    return entries, metadata, start


def _check_entry(name: str, entry: Any, total: int, where: str) -> dict[str, Any]:
    bad = CheckpointError(f"{where}: the header entry of {name!r} is malformed: {entry!r}"[:300])
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        raise bad
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise bad
    begin, stop = offsets
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
    if not 0 <= begin <= stop or stop - begin != numel * itemsize:
        raise bad
    if stop > total:
        raise CheckpointError(f"{where}: tensor {name!r} ends at byte {stop} of the data, which has "
                              f"only {total} bytes (truncated?)")
    return {"dtype": DTYPES[entry["dtype"]], "shape": tuple(shape), "begin": begin, "end": stop}


Select = Callable[[str], tuple[int, int] | bool]  # a tensor read whole (True), left out (False) or those rows


def read_tensors(path: str | os.PathLike[str], expect_sha256: str | None = None,
                 select: Select | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name, metadata) of a tensor file; with `expect_sha256`, its bytes are checked
    (nothing is returned from a file that does not match). `select(name)`: True reads the tensor,
    False leaves it out, (start, stop) reads its rows start:stop along dim 0 (a 0-dim tensor whole):
    what a replica of a sharded parameter keeps. The file is read once, in blocks, beside the hash:
    memory holds the tensors returned and one block, never the whole file."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            head += f.read(min(length, _MAX_HEADER, max(size - 8, 0)))
            entries, metadata, start = read_header(head, where, size)
            picked = {name: True if select is None else select(name) for name in entries}
            spans = _spans(entries, picked, where)
            out = {name: torch.empty(stop - begin, dtype=torch.uint8) for name, (begin, stop) in spans.items()}
            digest = hashlib.sha256(head) if expect_sha256 is not None else None
            if digest is not None:  # every byte through the hash, the spans copied out on the way
                _stream(f, start, size, spans, out, digest)
            else:
                for name, (begin, stop) in spans.items():
                    f.seek(start + begin)
                    if f.readinto(out[name].numpy()) != stop - begin:  # type: ignore[arg-type]
                        raise CheckpointError(f"{where}: ends inside tensor {name!r} (truncated?)")
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read it ({e.strerror or e})") from None
    if digest is not None and digest.hexdigest() != expect_sha256:
        raise CheckpointError(
            f"{where}: its sha256 is {digest.hexdigest()[:16]}..., the checkpoint recorded {str(expect_sha256)[:16]}...: "
            f"the file was changed or damaged after it was written"
        )
    tensors = {}
    for name, raw in out.items():
        entry, shape = entries[name], list(entries[name]["shape"])
        rows = picked[name]
        if not isinstance(rows, bool) and shape:
            shape[0] = rows[1] - rows[0]
        tensors[name] = raw.view(entry["dtype"]).reshape(shape) if raw.numel() else torch.empty(shape, dtype=entry["dtype"])
    return tensors, metadata


_BLOCK = 16 * 2**20  # bytes read at a time


def _spans(entries: Mapping[str, dict[str, Any]], picked: Mapping[str, tuple[int, int] | bool],
           where: str) -> dict[str, tuple[int, int]]:
    """The byte span [begin, end) of the data each tensor read takes (whole, or its rows picked)."""
    spans = {}
    for name, e in entries.items():
        rows = picked[name]
        if rows is False:
            continue
        if rows is True or not e["shape"]:
            spans[name] = (e["begin"], e["end"])
            continue
        first, last = rows
        if not 0 <= first <= last <= e["shape"][0]:
            raise CheckpointError(f"{where}: rows {first}:{last} of {name!r} asked, it has {e['shape'][0]}")
        row = (e["end"] - e["begin"]) // e["shape"][0] if e["shape"][0] else 0
        spans[name] = (e["begin"] + first * row, e["begin"] + last * row)
    return spans


def _stream(f: io.BufferedIOBase, start: int, size: int, spans: Mapping[str, tuple[int, int]],
            out: Mapping[str, torch.Tensor], digest: Any) -> None:
    """Read the data from `start` to `size` in blocks into `digest`, copying each span into `out`."""
    order = sorted(spans.items(), key=lambda item: item[1])
    pos, i = 0, 0  # pos: the data's byte the next block starts at
    block = bytearray(_BLOCK)
    while start + pos < size:
        n = f.readinto(memoryview(block)[: min(_BLOCK, size - start - pos)])
        if not n:
            break
        digest.update(memoryview(block)[:n])
        while i < len(order) and order[i][1][1] <= pos:
            i += 1
        j = i
        while j < len(order) and order[j][1][0] < pos + n:
            name, (begin, stop) = order[j]
            lo, hi = max(begin, pos), min(stop, pos + n)
            if lo < hi:
                out[name][lo - begin : hi - begin].copy_(torch.frombuffer(block, dtype=torch.uint8, offset=lo - pos,
                                                                          count=hi - lo))
            j += 1
        pos += n
