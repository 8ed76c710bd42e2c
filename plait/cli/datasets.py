"""Small real datasets for the demo and tests."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_digits", "mnist_files", "load_mnist_idx", "mnist_split"]

# IDX magic numbers: 0x0000 08 0N = unsigned byte data, N dimensions
# (http://yann.lecun.com/exdb/mnist/, "FILE FORMATS FOR THE MNIST DATABASE").
IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dims (count, rows, cols)
IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dim (count)

MNIST_IMAGES = "t10k-images-idx3-ubyte"
MNIST_LABELS = "t10k-labels-idx1-ubyte"

# Digits test set: every 5th image (0, 5, 10, ...), 360 of 1797. sklearn's digits come in blocks
# by writer, so a split at the end would test on writers never seen in training (about 0.94
# accuracy for the demo's CNN, against about 0.98 here); interleaving is as fair as a shuffled
# split and needs no random generator.
DIGITS_TEST_EVERY = 5
MNIST_TRAIN = 8000  # plait's convention on the 10,000-image MNIST test set:
MNIST_TEST = 2000  # train on the first 8,000, evaluate on the last 2,000

Pair = tuple[torch.Tensor, torch.Tensor]  # (x, y)
Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (x_train, y_train, x_test, y_test)


def load_digits() -> Split:
    """sklearn's 8x8 digits, split deterministically: (x_train, y_train, x_test, y_test).

    x is float32 (N, 1, 8, 8) in [0, 1]; y is int64. 1437 train images, and 360 test images:
    every 5th one (see DIGITS_TEST_EVERY).
    """
    from sklearn.datasets import load_digits as sklearn_digits  # type: ignore[import-untyped]  # the only sklearn use

    bunch = sklearn_digits()
    # Pixel values are integers 0..16 (sklearn docs, "Optical recognition of handwritten digits").
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # (1797, 1, 8, 8)
    y = torch.from_numpy(bunch.target.astype(np.int64))  # (1797,)
    test = torch.arange(len(x)) % DIGITS_TEST_EVERY == 0
    return x[~test], y[~test], x[test], y[test]


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(
        f"no {stem} or {stem}.gz in {directory}; expected the MNIST test set in IDX format "
        f"({MNIST_IMAGES}(.gz) and {MNIST_LABELS}(.gz))"
    )


def _read_idx(path: Path, magic: int, dims: int) -> tuple[tuple[int, ...], bytes]:
    """Return (shape, payload) of an IDX file after checking its magic number and size."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    header = 4 + 4 * dims
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes is shorter than the {header}-byte IDX header")
    (found,) = struct.unpack(">i", raw[:4])  # big-endian, like every IDX integer
    if found != magic:
        raise ValueError(
            f"{path}: IDX magic number is {found}, expected {magic} "
            f"({'images, 3 dims' if magic == IDX_IMAGES_MAGIC else 'labels, 1 dim'}); "
            "is this the right file, and not truncated or decompressed wrongly?"
        )
    shape = struct.unpack(f">{dims}i", raw[4:header])
    payload = raw[header:]
    expected = int(np.prod(shape))
    if len(payload) != expected:
        raise ValueError(
            f"{path}: header says shape {tuple(shape)} = {expected} bytes of data, "
            f"found {len(payload)}; the file is truncated or corrupt"
        )
    return tuple(shape), payload


def mnist_files(directory: str | Path) -> tuple[Path, Path]:
    """The (images, labels) IDX files in `directory`, raw or gzipped; FileNotFoundError if absent."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a folder; expected one holding {MNIST_IMAGES}(.gz) "
                                f"and {MNIST_LABELS}(.gz)")
    return _find(directory, MNIST_IMAGES), _find(directory, MNIST_LABELS)


def load_mnist_idx(directory: str | Path) -> Pair:
    """Read the MNIST test set from `directory` (IDX files, gzip optional): (x, y).

    x is float32 (N, 1, 28, 28) in [0, 1]; y is int64 (N,).
    """
    images_path, labels_path = mnist_files(directory)
    (n, rows, cols), pixels = _read_idx(images_path, IDX_IMAGES_MAGIC, dims=3)
    (n_labels,), labels = _read_idx(labels_path, IDX_LABELS_MAGIC, dims=1)
    if n != n_labels:
        raise ValueError(
            f"{images_path} holds {n} images but {labels_path} holds {n_labels} labels; "
            "they must come from the same set"
        )
    x = np.frombuffer(pixels, dtype=np.uint8).reshape(n, 1, rows, cols).astype(np.float32)
    y = np.frombuffer(labels, dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(x / 255.0), torch.from_numpy(y)  # (N, 1, 28, 28), (N,)


def mnist_split(directory: str | Path) -> Split:
    """MNIST test set split as plait's convention: train on the first 8,000, test on the last 2,000."""
    x, y = load_mnist_idx(directory)
    if len(x) < MNIST_TRAIN + MNIST_TEST:
        raise ValueError(
            f"{directory} holds {len(x)} images; the split needs "
            f"{MNIST_TRAIN + MNIST_TEST} (the 10,000-image MNIST test set)"
        )
    return x[:MNIST_TRAIN], y[:MNIST_TRAIN], x[-MNIST_TEST:], y[-MNIST_TEST:]
