"""An exception in the model's own code on one rank: the user's exception and line first, every rank ended at once.

A forward that raised on rank 0 reached the user 20 s late, as `PipelineError ... at action 0F0
(step 0)` (a column of the action grid, not a training step), while rank 1 waited out its
timeout and reported a `WireTimeout`; no message named the batch. Now rank 0 raises a ModelError
naming the user's exception, its line and the epoch and batch, from the user's exception (whose
traceback Python prints first); it closes its connections, so rank 1 stops within moments and
names rank 0's exception too. Both well under the 20 s timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import plait
from tests.harness import run_ranks

TIMEOUT_S = 20.0


class Check(nn.Module):
    """Raises on a batch holding a marked value: data-dependent, so plait keeps it whole and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 1000).any():
            raise ValueError("a marked value reached the check")
        return self.lin(x)


def fit_until_it_raises(rank, world):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(15, 8, generator=g), torch.randint(0, 4, (15,), generator=g)
    x[7, 0] = 1e6  # batch 2 of 3 (rows 5-9)
    net = nn.Sequential(Check(), nn.Linear(8, 8), nn.Linear(8, 4))
    model = plait.Model(net, plait.Config(layers_per_stage=[1, 2], num_microbatches=2, timeout_s=TIMEOUT_S),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    model.build(x[:5])
    start = time.monotonic()
    try:
        model.fit(x, y, epochs=1, batch_size=5, shuffle=False, verbose=0)
    except plait.PlaitError as e:
        cause = e.__cause__
        return type(e).__name__, str(e), type(cause).__name__ if cause else None, time.monotonic() - start
    return None, "no error", None, time.monotonic() - start


@pytest.mark.timeout(120)
def test_a_forward_that_raises_is_named_on_every_rank_and_every_rank_ends_at_once():
    (kind, message, cause, waited), (peer_kind, peer_message, _, peer_waited) = run_ranks(
        2, fit_until_it_raises, timeout=110)
    assert kind == "ModelError" and cause == "ValueError", (kind, message)
    assert message.startswith("rank 0: the model's code raised ValueError: a marked value reached the check")
    assert 'test_failure.py", line' in message and "in forward: raise ValueError(" in message, message
    assert "epoch 1, batch 2 (training step 2)" in message, message
    assert peer_kind == "ModelError", peer_message
    assert "rank 1 stopped" in peer_message and "rank 0 raised ValueError: a marked value" in peer_message
    assert "epoch 1, batch 2" in peer_message and "WireTimeout" not in peer_message, peer_message
    assert waited < 8.0 and peer_waited < 8.0, (waited, peer_waited)  # not the 20 s timeout
