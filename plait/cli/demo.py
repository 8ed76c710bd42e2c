"""The paper's MNIST CNN experiment at small scale.

Every rank runs this file (`plait demo` starts them; `python -m plait.cli.demo` alone runs one
process with every layer on one stage). The data is sklearn's 8x8 digits by default, or the
MNIST test set from IDX files with --data DIR, trained on its first 8,000 images and tested
on the last 2,000.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
from torch import nn

import plait
from plait.cli import datasets

__all__ = ["PaperCNN", "parse_args", "main"]


class PaperCNN(nn.Sequential):
    """The paper's MNIST CNN (the Keras mnist_cnn example), for square inputs of side in_hw."""

    def __init__(self, in_hw: int = 28) -> None:
        side = (in_hw - 4) // 2  # two 3x3 convolutions (no padding) then a 2x2 max-pool
        if side < 1:
            raise ValueError(f"PaperCNN needs inputs of at least 6x6 pixels (in_hw: {in_hw})")
        super().__init__(
            nn.Conv2d(1, 32, 3), nn.ReLU(),  # (B, 32, hw-2, hw-2)
            nn.Conv2d(32, 64, 3), nn.ReLU(),  # (B, 64, hw-4, hw-4)
            nn.MaxPool2d(2),  # (B, 64, side, side)
            nn.Dropout(0.25),
            nn.Flatten(),  # (B, 64 * side * side): 9216 for MNIST, 256 for 8x8 digits
            nn.Linear(64 * side * side, 128), nn.ReLU(),  # (B, 128)
            nn.Dropout(0.5),
            nn.Linear(128, 10),  # (B, 10) logits
        )


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Training defaults per data set, chosen to reach their accuracy in about a minute or two."""

    epochs: int
    lr: float  # Adam


# MNIST: 8,000 images in batches of 1000 give only 8 optimizer steps an epoch, so Adam runs at
# 4x the Keras example's 1e-3; the paper's 5 epochs then reached 0.970-0.977 test accuracy
# over the seeds we tried. Digits: 1437 images are 2 steps an epoch, each well under a second.
DEFAULTS = {
    "mnist": Defaults(epochs=5, lr=4e-3),
    "digits": Defaults(epochs=25, lr=1e-2),
}


def build_parser(prog: str = "python -m plait.cli.demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", metavar="DIR", default=None,
                        help="folder with t10k-images-idx3-ubyte(.gz) and t10k-labels-idx1-ubyte(.gz) "
                             "(default: sklearn's 8x8 digits, no download)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"default: {DEFAULTS['digits'].epochs} on digits, {DEFAULTS['mnist'].epochs} on MNIST")
    parser.add_argument("--batch-size", type=int, default=1000, help="global batch (default: 1000)")
    parser.add_argument("--microbatches", type=int, default=10, help="micro-batches per batch (default: 10)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"Adam learning rate (default: {DEFAULTS['digits'].lr:g} on digits, "
                             f"{DEFAULTS['mnist'].lr:g} on MNIST)")
    parser.add_argument("--seed", type=int, default=0, help="weights and shuffling (default: 0)")
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "python -m plait.cli.demo") -> argparse.Namespace:
    """The demo's options; exits with a usage message when they are wrong."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.data is not None:
        try:
            datasets.mnist_files(args.data)
        except FileNotFoundError as err:
            parser.error(f"--data: {err}")
    for name in ("epochs", "batch_size", "microbatches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    if args.lr is not None and args.lr <= 0:
        parser.error(f"--lr must be positive (got {args.lr})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # -- data ---------------------------------------------------------------------------------
    if args.data is None:
        name, (x_train, y_train, x_test, y_test) = "digits", datasets.load_digits()
    else:
        name, (x_train, y_train, x_test, y_test) = "mnist", datasets.mnist_split(args.data)
    defaults = DEFAULTS[name]
    epochs = args.epochs if args.epochs is not None else defaults.epochs
    lr = args.lr if args.lr is not None else defaults.lr

    # -- model: an ordinary nn.Module, the same initial weights on every rank ----------------
    torch.manual_seed(args.seed)
    net = PaperCNN(in_hw=x_train.shape[-1])
    model = plait.Model(
        net,
        config=plait.Config(num_stages=2, num_microbatches=args.microbatches, schedule="1f1b",
                            seed=args.seed),
        # A callable, so each rank's Adam holds state only for the parameters of its own stage.
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        loss=nn.CrossEntropyLoss(),
        metrics=["accuracy"],
    )

    # -- train and test (fit prints the plan and a progress bar on rank 0) -------------------
    start = time.perf_counter()
    model.fit(x_train, y_train, epochs=epochs, batch_size=args.batch_size, shuffle=True, verbose=1)
    train_time_s = time.perf_counter() - start
    result = model.evaluate(x_test, y_test, batch_size=args.batch_size)

    if model.rank == 0:
        print(
            f"plait demo: stages={model.plan.num_stages} "
            f"microbatches={args.microbatches} epochs={epochs} train_time_s={train_time_s:.1f} "
            f"test_loss={result['loss']:.4f} test_accuracy={result['accuracy']:.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
