"""The model's own code raising while plait captures it, on 2 ranks: every rank ends at once, naming it.

A forward that raised during capture came out as a `CaptureError` pointing into torch's module.py
that advised avoiding data-dependent control flow, on the rank where it raised; a rank whose model
captured fine went on to plan and waited for the layout. Now the rank where it raised names the
user's exception and line, posts it and closes its connections, and the other rank stops within
moments, naming the same exception.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import plait
from tests.harness import run_ranks

TIMEOUT_S = 20.0


class Guarded(nn.Module):
    """Raises on the rank it is told to, as a user's check on its inputs does."""

    def __init__(self, raising_rank: int) -> None:
        super().__init__()
        self.lin, self.raising_rank = nn.Linear(8, 8), raising_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.get_rank() == self.raising_rank:
            raise ValueError("the input has no padding column")
        return self.lin(x)


def fit_until_capture_raises(rank, world, raising_rank):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    net = nn.Sequential(Guarded(raising_rank), nn.Linear(8, 8), nn.Linear(8, 4))
    model = plait.Model(net, plait.Config(num_stages=2, timeout_s=TIMEOUT_S),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    start = time.monotonic()
    try:
        model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    except plait.PlaitError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "no error", time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("raising_rank", [0, 1])
def test_a_forward_raising_during_capture_on_one_rank_ends_both_naming_it(raising_rank):
    results = run_ranks(2, fit_until_capture_raises, raising_rank, timeout=110)
    (kind, message, waited), (peer_kind, peer_message, peer_waited) = (
        results[raising_rank], results[1 - raising_rank])
    assert kind == "ModelError", message
    assert message.startswith("the model's code raised ValueError: the input has no padding column\n"), message
    assert 'test_capture_raised.py", line' in message and "in forward: raise ValueError(" in message, message
    assert peer_kind == "ModelError", peer_message
    assert f"rank {raising_rank} raised ValueError: the input has no padding column while capturing" \
        in peer_message, peer_message
    assert 'test_capture_raised.py", line' in peer_message, peer_message
    assert waited < 10.0 and peer_waited < 10.0, (waited, peer_waited)  # not the 20 s timeout nor the plan's wait
