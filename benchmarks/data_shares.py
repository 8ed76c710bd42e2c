"""Samples each rank loads per step, and the step time, with each replica reading only its rows
of a data set (`plait.train.shares`) against every rank reading every global batch (before).

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each, `Config(dp=2, num_stages=1,
num_microbatches=1)`. The data: the real MNIST test set (../shared/data/mnist, first 8,000 images),
each image stored zlib-compressed and, when loaded, decompressed, scaled to --size x --size pixels
(bilinear), blurred (5x5 Gaussian) and normalised: decoding and augmenting an image, on real pixels,
about 0.5 ms a sample on one core. The model, light beside it: 4x4 average pooling, then a small CNN
(two 3x3 convolutions of 16 and 32 channels, each with ReLU and 2x2 max pooling, a linear classifier), SGD, `fit(dataset, batch_size=--batch)` for one epoch of --steps
batches a round (shuffled), the rounds alternating between the two readings:

    before  every rank loads every global batch and keeps its slice (as fit read data sets before)
    shares  each replica loads its rows only

Both train the same model from one init on the same batches: their states after the first round
must be equal (max difference 0), else the benchmark stops. Printed: the samples each rank loaded
per step (after the first batch, which every rank loads whole to build on), the target (<= its
share, batch / dp, plus that one batch over the epoch), and the median seconds per step.

    python benchmarks/data_shares.py [--rounds 5] [--steps 20] [--batch 64] [--size 224]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import join_job, leave_job, run_job  # noqa: E402  (benchmarks/ is the script's own directory)

import plait.train.fit_loop as fit_loop  # noqa: E402

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


_TAPS = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
BLUR = (torch.outer(_TAPS, _TAPS) / 256.0).view(1, 1, 5, 5)


class Images(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """MNIST images kept compressed; a load decompresses, scales and normalises one (and counts it)."""

    def __init__(self, size: int, rows: int = 8000) -> None:
        raw = gzip.decompress((MNIST / "t10k-images-idx3-ubyte.gz").read_bytes())[16:]
        labels = gzip.decompress((MNIST / "t10k-labels-idx1-ubyte.gz").read_bytes())[8:]
        self.images = [zlib.compress(raw[i * 784:(i + 1) * 784], 9) for i in range(rows)]
        self.labels = torch.tensor(list(labels[:rows]), dtype=torch.long)
        self.size, self.loaded = size, 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        pixels = torch.frombuffer(bytearray(zlib.decompress(self.images[i])), dtype=torch.uint8)
        image = pixels.view(1, 1, 28, 28).float() / 255.0
        image = F.interpolate(image, size=(self.size, self.size), mode="bilinear", align_corners=False)
        image = F.conv2d(image, BLUR, padding=2)[0]  # the augmentation: a 5x5 Gaussian blur
        return (image - 0.1307) / 0.3081, self.labels[i]


def cnn(size: int) -> nn.Module:
    """4x4 average pooling of the input, then the small CNN."""
    torch.manual_seed(0)
    return nn.Sequential(nn.AvgPool2d(4), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * (size // 16) ** 2, 10))


def rank_main(rank: int, port: int, world: int, args: argparse.Namespace, result: str) -> None:
    join_job(rank, world, port)
    torch.set_num_threads(1)
    data = {name: Images(args.size, args.steps * args.batch) for name in ("before", "shares")}
    models = {name: plait.Model(cnn(args.size), plait.Config(dp=2, num_stages=1, num_microbatches=1),
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                                loss=nn.CrossEntropyLoss()) for name in data}
    share_batches = fit_loop.share_batches
    per_step: dict[str, list[float]] = {name: [] for name in data}
    loaded: dict[str, list[float]] = {name: [] for name in data}
    for r in range(args.rounds + 1):
        for name in (("before", "shares") if r % 2 == 0 else ("shares", "before")):
            fit_loop.share_batches = share_batches if name == "shares" else (lambda *a, **k: None)  # type: ignore[assignment]
            first = r == 0
            data[name].loaded = 0
            dist.barrier()
            start = time.perf_counter()
            models[name].fit(data[name], epochs=1, batch_size=args.batch, shuffle=True, verbose=0)
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            build = args.batch if first else 0  # the batch loaded whole to build on
            loaded[name].append((data[name].loaded - build) / args.steps)
            if not first:
                per_step[name].append(float(wall) / args.steps)
        if r == 0:
            states = [m.state_dict() for m in models.values()]
            worst = max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0])
            if worst != 0.0:
                raise SystemExit(f"the two readings trained differently: largest difference {worst}")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, loaded)
    if rank == 0:
        Path(result).write_text(json.dumps({"loaded": gathered,
                                            "step": {k: statistics.median(v) for k, v in per_step.items()}}))
    fit_loop.share_batches = share_batches
    leave_job()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rounds", 5), ("steps", 20), ("batch", 64), ("size", 224)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if not MNIST.exists():
        raise SystemExit(f"no MNIST test set at {MNIST}: this benchmark reads real images")
    out = json.loads(run_job(rank_main, 2, 2, args))
    share = args.batch / 2
    print(f"MNIST images scaled to {args.size} x {args.size}, CNN, dp=2 on 2 gloo ranks x 1 thread, "
          f"{args.steps} steps of {args.batch} rows a round, {args.rounds} rounds (medians); states equal after round 1")
    for rank, loaded in enumerate(out["loaded"]):
        print(f"  rank {rank} samples loaded per step   before {max(loaded['before']):7.1f}   "
              f"shares {max(loaded['shares']):7.1f}   (its share {share:.0f}; target <= {share:.0f} "
              f"+ {args.batch} / {args.steps} steps = {share + args.batch / args.steps:.1f})")
    step = out["step"]
    print(f"  seconds per step (slowest rank)  before {step['before'] * 1e3:7.2f} ms   shares "
          f"{step['shares'] * 1e3:7.2f} ms   shares / before = {step['shares'] / step['before']:.3f}")


if __name__ == "__main__":
    main()
