"""`if rank == 0: torch.save(model.state_dict(), ...)`: the rank alone is told to call it on every rank.

state_dict() gathers each stage from the rank that runs it. Called on rank 0 alone it waited in a
gather no peer joined and ended in gloo's own words (`Timed out waiting 20000ms for recv
operation`, or `Connection closed by peer` once the peers' scripts ended). Now it says that every
rank must call it: at once where the peers' scripts have ended (each leaves a mark in the job's
store as it exits), else after Config.timeout_s.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import plait
from plait.job.together import mark_ended
from tests.harness import run_ranks
from tests.models import even_cut, mlp

TIMEOUT_S = 3.0


def save_on_rank_0_only(rank, world, peer_ends):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)
    model = plait.Model(mlp(), plait.Config(layers_per_stage=even_cut(11, 2), num_microbatches=2, timeout_s=TIMEOUT_S),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    model.fit(x, y, epochs=1, batch_size=6, verbose=0)
    state = model.state_dict()  # every rank: works as before
    if rank != 0:
        if peer_ends:
            mark_ended()  # what this rank's exit does (plait.job.process_group)
        return None
    start = time.monotonic()
    try:
        model.state_dict()
    except plait.ConfigError as e:
        return str(e), time.monotonic() - start, sorted(state)
    return "no error", time.monotonic() - start, sorted(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer_ends", [True, False], ids=["peer's script ended", "peer elsewhere"])
def test_state_dict_on_one_rank_says_every_rank_must_call_it(peer_ends):
    message, waited, keys = run_ranks(2, save_on_rank_0_only, peer_ends, timeout=110)[0]
    assert "model.state_dict() is a collective: every rank must call it" in message, message
    assert "state = model.state_dict(), then if model.rank == 0: torch.save(state, path)" in message
    assert keys == sorted(mlp().state_dict())
    if peer_ends:
        assert "ranks [1] ended their script without calling it" in message
        assert waited < 2.0, waited
    else:
        assert f"1 of the 2 ranks did not call it within {TIMEOUT_S:g} s" in message
        assert TIMEOUT_S <= waited < TIMEOUT_S + 2.0, waited
