"""Tests for plait.runtime.tp.vocab_loss: the loss of logits split by vocabulary over 2 gloo ranks equals
one process's (value, and the gradient of each rank's part), run on the parts where it is a
cross-entropy (reshaped, shifted, with ignored targets, summed) and on gathered logits otherwise;
a vocabulary that does not divide by the ranks too (9 words: parts of 5 and 4)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.runtime.tp.vocab_loss import SplitLoss
from plait.tensor_parts import local_part
from tests.harness import run_ranks

B, T, V = 3, 5, 8


def _plain(x: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1))


def _shifted(x: Any, y: torch.Tensor) -> torch.Tensor:  # next-token, some targets ignored
    return F.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100)


def _summed(x: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum") / 7.0


def _smoothed(x: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), label_smoothing=0.1)


def _squares(x: Any, y: torch.Tensor) -> torch.Tensor:
    return (x ** 2).mean()


LOSSES: dict[str, tuple[Callable[[Any, torch.Tensor], torch.Tensor], str]] = {
    "plain": (_plain, "split"), "shifted": (_shifted, "split"), "summed": (_summed, "split"),
    "smoothed": (_smoothed, "gathered"), "squares": (_squares, "gathered"),
}


def _check(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for vocab in (V, V + 1):
        out.update({(name, vocab): value for name, value in _losses(rank, world, vocab).items()})
    return out


def _losses(rank: int, world: int, vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(B, T, vocab, generator=g) * 3
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, 2] = y[2, 4] = -100
    y[1, 1] = vocab - 1  # the last rank's last column
    out = {}
    for name, (loss_fn, _) in LOSSES.items():
        ref = whole.clone().requires_grad_(True)
        want = loss_fn(ref, y.clamp(min=0) if name != "shifted" else y)
        want.backward()
        part = local_part(whole, 2, 1, rank, world).clone().requires_grad_(True)
        split = SplitLoss(lambda leaves: leaves[0], loss_fn, {0: (2, 1, vocab)}, dist.group.WORLD, rank, world)
        target = y.clamp(min=0) if name != "shifted" else y
        got = split([part], target)
        got.backward()
        out[name] = (float(got), float(want), float((part.grad - local_part(ref.grad, 2, 1, rank, world)).abs().max()),
                     dict(split.calls))
    return out


@pytest.mark.timeout(120)
def test_split_loss_equals_one_process_on_the_parts_or_gathered() -> None:
    for rank, results in enumerate(run_ranks(2, _check, timeout=100)):
        assert len(results) == 2 * len(LOSSES)
        for (name, vocab), (got, want, grad_error, calls) in results.items():
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, name)
            assert grad_error < 1e-6, (rank, name, grad_error)
            assert calls == {"split": 1 if LOSSES[name][1] == "split" else 0,
                             "gathered": 1 if LOSSES[name][1] == "gathered" else 0}, (rank, name, calls)
