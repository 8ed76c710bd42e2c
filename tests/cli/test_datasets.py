"""Tests for plait.cli.datasets: the digits split, the IDX reader, and the real MNIST test set."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli import datasets

ROOT = Path(__file__).resolve().parents[2]
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"  # ../shared/data/mnist from the project root


def write_idx(directory: Path, images: np.ndarray, labels: np.ndarray, gz: bool,
              images_magic: int = 2051) -> None:
    """Write a tiny MNIST-like IDX pair: big-endian magic, counts, rows, cols, then uint8 data."""
    n, rows, cols = images.shape
    image_bytes = struct.pack(">4i", images_magic, n, rows, cols) + images.astype(np.uint8).tobytes()
    label_bytes = struct.pack(">2i", 2049, len(labels)) + labels.astype(np.uint8).tobytes()
    suffix = ".gz" if gz else ""
    write = gzip.open if gz else open
    with write(directory / f"t10k-images-idx3-ubyte{suffix}", "wb") as f:
        f.write(image_bytes)
    with write(directory / f"t10k-labels-idx1-ubyte{suffix}", "wb") as f:
        f.write(label_bytes)


def test_digits_shapes_and_split() -> None:
    x_train, y_train, x_test, y_test = datasets.load_digits()
    assert x_train.shape == (1437, 1, 8, 8) and x_test.shape == (360, 1, 8, 8)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) == 1.0
    assert set(y_test.tolist()) == set(range(10))
    again = datasets.load_digits()
    assert torch.equal(again[2], x_test)  # deterministic


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_idx_reader_roundtrip(tmp_path: Path, gz: bool) -> None:
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5) * 4
    labels = np.array([7, 0, 9], dtype=np.uint8)
    write_idx(tmp_path, images, labels, gz)
    x, y = datasets.load_mnist_idx(tmp_path)
    assert x.shape == (3, 1, 4, 5) and x.dtype == torch.float32
    assert torch.allclose(x[:, 0], torch.from_numpy(images.astype(np.float32) / 255.0))
    assert y.tolist() == [7, 0, 9] and y.dtype == torch.int64


def test_idx_bad_magic_names_the_file(tmp_path: Path) -> None:
    write_idx(tmp_path, np.zeros((2, 3, 3), np.uint8), np.zeros(2, np.uint8), gz=True, images_magic=2049)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz.*magic number is 2049, expected 2051"):
        datasets.load_mnist_idx(tmp_path)


def test_idx_truncated_file_says_sizes(tmp_path: Path) -> None:
    write_idx(tmp_path, np.zeros((2, 3, 3), np.uint8), np.zeros(2, np.uint8), gz=False)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: header says shape \(2, 3, 3\) = 18 bytes.*found 17"):
        datasets.load_mnist_idx(tmp_path)


def test_idx_count_mismatch(tmp_path: Path) -> None:
    write_idx(tmp_path, np.zeros((2, 3, 3), np.uint8), np.zeros(3, np.uint8), gz=False)
    with pytest.raises(ValueError, match="holds 2 images but .* holds 3 labels"):
        datasets.load_mnist_idx(tmp_path)


def test_idx_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no t10k-images-idx3-ubyte or t10k-images-idx3-ubyte.gz in"):
        datasets.load_mnist_idx(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        datasets.mnist_files(tmp_path / "absent")


def test_real_mnist_test_set() -> None:
    if not (MNIST_DIR / "t10k-labels-idx1-ubyte.gz").exists():
        pytest.skip(f"the real MNIST test set is not at ../shared/data/mnist from the project root ({MNIST_DIR})")
    x, y = datasets.load_mnist_idx(MNIST_DIR)
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.float32
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    counts = torch.bincount(y, minlength=10).tolist()
    assert counts == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    x_train, y_train, x_test, y_test = datasets.mnist_split(MNIST_DIR)
    assert len(x_train) == len(y_train) == 8000 and len(x_test) == len(y_test) == 2000
    assert torch.equal(x_test, x[-2000:])
