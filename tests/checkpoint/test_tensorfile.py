"""The tensor file: safetensors bytes both ways, every dtype, and damage reported as CheckpointError."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch

from plait.checkpoint import tensorfile
from plait.errors import CheckpointError

TENSORS = {
    "w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "empty": torch.empty(0, 3),
    "half": torch.arange(6, dtype=torch.float16).reshape(2, 3),
    "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "ints": torch.arange(5, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "bytes": torch.tensor([0, 255], dtype=torch.uint8),
    "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: written in row-major order
}


def write(tmp_path, tensors=TENSORS, metadata=None):
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as f:
        digest = tensorfile.write_tensors(f, tensors, metadata or {"plait": "{}"})
    return path, digest


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_round_trip_of_every_dtype_with_metadata_and_sha256(tmp_path):
    path, digest = write(tmp_path, metadata={"plait": '{"a": 1}'})
    import hashlib

    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    tensors, metadata = tensorfile.read_tensors(path, digest)
    assert_same(tensors, TENSORS)
    assert metadata == {"plait": '{"a": 1}'}
    assert len(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]]) % 8 == 0


def test_the_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    path, _ = write(tmp_path)
    assert_same(st.load_file(str(path)), TENSORS)
    theirs = tmp_path / "theirs.safetensors"
    st.save_file({k: v.contiguous() for k, v in TENSORS.items()}, str(theirs), metadata={"k": "v"})
    tensors, metadata = tensorfile.read_tensors(theirs)
    assert_same(tensors, TENSORS)
    assert metadata == {"k": "v"}


def test_a_changed_byte_fails_the_sha256_and_a_cut_file_fails_the_header(tmp_path):
    path, digest = write(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"sha256 is .*, the checkpoint recorded .*changed or damaged"):
        tensorfile.read_tensors(path, digest)
    path.write_bytes(bytes(raw[:-5]))
    with pytest.raises(CheckpointError, match=r"tensor 'view' ends at byte \d+ of the data, which has only "
                                              r"\d+ bytes \(truncated\?\)"):
        tensorfile.read_tensors(path)
    path.write_bytes(bytes(raw[:20]))
    with pytest.raises(CheckpointError, match=r"header says it is \d+ bytes but the file has 20"):
        tensorfile.read_tensors(path)
    with pytest.raises(CheckpointError, match="cannot read it"):
        tensorfile.read_tensors(tmp_path / "missing.safetensors")


def _file(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("header, data, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "malformed"),  # 2 x 4 bytes
    ({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "malformed"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "malformed"),
    ({"a": {"dtype": "F32", "shape": [2 ** 70], "data_offsets": [0, 4]}}, b"\0" * 4, "malformed"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap at byte 0"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "overlaps"),
    ({"a": [1, 2]}, b"", "malformed"),
    ({"__metadata__": {"k": 1}}, b"", "must map names to strings"),
    ([1, 2], b"", "not a JSON object"),
])
def test_hostile_headers_are_refused_before_any_tensor_is_made(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_file(header, data))
    with pytest.raises(CheckpointError, match=message):
        tensorfile.read_tensors(path)


def test_unsupported_dtypes_are_named_when_writing():
    with pytest.raises(CheckpointError, match=r"tensor 'u' has dtype torch.uint16, which plait cannot save"):
        tensorfile.write_tensors(io.BytesIO(), {"u": torch.zeros(2, dtype=torch.uint16)}, {})


def test_select_reads_some_tensors_whole_and_of_others_only_rows_through_the_hash(tmp_path, monkeypatch):
    big = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    tensors = {"big": big, "step": torch.tensor(3.0), "other": torch.ones(5, 2, dtype=torch.bfloat16)}
    path = tmp_path / "s.safetensors"
    with open(path, "wb") as f:
        digest = tensorfile.write_tensors(f, tensors, {})
    monkeypatch.setattr(tensorfile, "_BLOCK", 64)  # spans cut by many blocks
    picks = {"big": (7, 23), "step": (0, 1), "other": False}  # (a 0-dim tensor is read whole)
    for sha in (digest, None):
        got, _ = tensorfile.read_tensors(path, sha, lambda name: picks[name])
        assert sorted(got) == ["big", "step"]
        assert torch.equal(got["big"], big[7:23]) and torch.equal(got["step"], tensors["step"])
    got, _ = tensorfile.read_tensors(path, digest, lambda name: name == "other")
    assert sorted(got) == ["other"] and torch.equal(got["other"], tensors["other"])
    empty, _ = tensorfile.read_tensors(path, digest, lambda name: (5, 5) if name == "big" else False)
    assert empty["big"].shape == (0, 6)
    with pytest.raises(CheckpointError, match="rows 30:50 of 'big' asked, it has 40"):
        tensorfile.read_tensors(path, digest, lambda name: (30, 50) if name == "big" else False)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a byte of a tensor not read: the hash still sees it
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        tensorfile.read_tensors(path, digest, lambda name: name == "step")
