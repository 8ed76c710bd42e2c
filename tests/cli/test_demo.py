"""The demo: the paper's CNN, and its MNIST run through `plait demo` reaching the paper's accuracy."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from plait.cli.demo import PaperCNN

MNIST = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mnist"


@pytest.mark.parametrize("side, flat", [(28, 9216), (8, 256)])
def test_paper_cnn_layers_and_shapes(side, flat):
    net = PaperCNN(in_hw=side)
    kinds = [type(m).__name__ for m in net]
    assert kinds == ["Conv2d", "ReLU", "Conv2d", "ReLU", "MaxPool2d", "Dropout", "Flatten",
                     "Linear", "ReLU", "Dropout", "Linear"]
    assert net[7].in_features == flat and net[7].out_features == 128
    assert (net[5].p, net[9].p) == (0.25, 0.5)
    assert net(torch.zeros(3, 1, side, side)).shape == (3, 10)


@pytest.mark.timeout(400)
def test_mnist_demo_reaches_the_papers_accuracy():
    if not (MNIST / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip(f"MNIST test set not found at {MNIST} (see the data README); skipping")
    result = subprocess.run(
        [sys.executable, "-m", "plait.cli", "demo", "--data", str(MNIST)],
        capture_output=True, text=True, timeout=380,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("plait demo:")]
    assert summary, result.stdout[-2000:]
    accuracy = float(re.search(r"test_accuracy=([0-9.]+)", summary[-1]).group(1))
    assert "stages=2 microbatches=10" in summary[-1]
    assert "stage 1 (rank 1)" in result.stdout  # the plan summary was printed
    assert accuracy >= 0.97, summary[-1]
