"""A value rank 0 makes for every rank (the layout plan): where the model's code raised making it, both ranks say so.

The other rank read `ConfigError: rank 0 failed while making the layout plan: ValueError: ...`, as
if its configuration were wrong. Now both ranks raise a ModelError that says the model's code
raised, and where (the user's line); a plait error stays what it was.
"""

from __future__ import annotations

import pytest

import plait
from plait.runtime.agree import agree
from tests.harness import run_ranks


def profile_the_model():
    raise ValueError("the forward found a NaN")  # the user's code, as the profiler runs it


def bad_config():
    raise plait.ConfigError("num_stages=3 does not fit")


def make_both(rank, world):
    plait.init_process_group(30.0)
    out = []
    for make in (profile_the_model, bad_config):
        try:
            agree(rank, make, "layout plan", wait_s=30.0)
        except plait.PlaitError as e:
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.timeout(60)
def test_the_model_raising_on_rank_0_is_named_on_every_rank():
    (mine, config), (peers, peer_config) = run_ranks(2, make_both, timeout=50)
    for kind, message in (mine, peers):
        assert kind == "ModelError", message
        assert "the model's code raised ValueError: the forward found a NaN" in message, message
        assert 'test_agree.py", line' in message and "in profile_the_model: raise ValueError(" in message
        assert "to make the layout plan" in message
    assert peers[1].startswith("rank 0 stopped")
    assert config[0] == "ConfigError" and peer_config == ("ConfigError", "rank 0 failed while making the "
                                                          "layout plan: ConfigError: num_stages=3 does not fit")
