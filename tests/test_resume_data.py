"""Resuming `fit` from a checkpoint: the same data resumes, other data of the same size is refused.

A checkpoint's data position is (epoch, batches done); it is only meaningful for the data it was
saved with. plait checks what fixes the order of the batches (seed, shuffle, batch_size, rows,
batches per epoch) and a fingerprint of the data's values: other data with as many rows would
otherwise resume silently, trained on as if it were the rest of the first run's epochs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from tests.models import mlp


def data(seed: int, n: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def model(root) -> plait.Model:
    torch.manual_seed(0)
    config = plait.Config(checkpoint_dir=root, checkpoint_every=2)
    return plait.Model(mlp(), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())


class Epochs:
    """The epochs a fit runs."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: dict) -> None:
        self.epochs.append(epoch)


def test_the_same_data_resumes(tmp_path):
    x, y = data(seed=0)
    model(tmp_path).fit(x, y, epochs=1, batch_size=5, verbose=0)  # 5 steps; checkpoints at 2, 4, 5
    epochs = Epochs()
    resumed = model(tmp_path)
    resumed.fit(x, y, epochs=2, batch_size=5, verbose=0, callbacks=[epochs])
    assert epochs.epochs == [1] and resumed.step == 10  # steps 6..10: the first epoch is not trained again


def test_other_data_of_the_same_size_is_an_error_naming_the_fix(tmp_path):
    x, y = data(seed=0)
    model(tmp_path).fit(x, y, epochs=1, batch_size=5, verbose=0)
    other_x, other_y = data(seed=1)  # 23 rows as before, other values
    with pytest.raises(plait.CheckpointError, match=r"(?s)data.*same data.*another checkpoint_dir"):
        model(tmp_path).fit(other_x, other_y, epochs=2, batch_size=5, verbose=0)
