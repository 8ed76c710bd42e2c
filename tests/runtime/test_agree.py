"""A value rank 0 makes for every rank (the layout plan): where the model's code raised making it, both ranks say so.

The other rank read `ConfigError: rank 0 failed while making the layout plan: ValueError: ...`, as
if its configuration were wrong. Now both ranks raise a ModelError that says the model's code
raised, and where (the user's line); a plait error stays what it was.
"""

from __future__ import annotations

import pytest

import plait
from plait.runtime import failure as agree_report
from plait.runtime.agree import agree
from tests.harness import run_ranks


def profile_the_model():
    raise ValueError("the forward found a NaN")  # the user's code, as the profiler runs it


def bad_config():
    raise plait.ConfigError("num_stages=3 does not fit")


def bad_cut():
    raise plait.PartitionError("3 stages but the model has 2 layers")


def make_both(rank, world):
    plait.init_process_group(30.0)
    out = []
    for make in (profile_the_model, bad_config, bad_cut):
        try:
            agree(rank, make, "layout plan", wait_s=30.0)
        except plait.PlaitError as e:
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.timeout(60)
def test_the_model_raising_on_rank_0_is_named_on_every_rank():
    (mine, config, cut), (peers, peer_config, peer_cut) = run_ranks(2, make_both, timeout=50)
    for kind, message in (mine, peers):
        assert kind == "ModelError", message
        assert "the model's code raised ValueError: the forward found a NaN" in message, message
        assert 'test_agree.py", line' in message and "in profile_the_model: raise ValueError(" in message
        assert "to make the layout plan" in message
    assert peers[1].startswith("rank 0 stopped")
    assert config[0] == "ConfigError" and peer_config == ("ConfigError", "rank 0 failed while making the "
                                                          "layout plan: ConfigError: num_stages=3 does not fit")
    # plait's error keeps its class on every rank: a wrong cut is a PartitionError on both
    assert cut[0] == "PartitionError" and peer_cut == ("PartitionError", "rank 0 failed while making the "
                                                       "layout plan: PartitionError: 3 stages but the model has 2 layers")


def rank_0_fails_before_agreeing(rank, world):
    import time

    plait.init_process_group(30.0)
    start = time.monotonic()
    if rank == 0:
        try:
            with agree_report.raised_before_steps(rank, "while capturing the model"):
                try:
                    profile_the_model()
                except ValueError as e:
                    raise plait.ModelError("the model's code raised") from e
        except plait.ModelError:
            return None
    try:
        agree(rank, lambda: 1, "layout plan", wait_s=60.0)
    except plait.PlaitError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None


@pytest.mark.timeout(60)
def test_a_rank_waiting_for_rank_0s_value_stops_when_rank_0_posts_a_failure_instead():
    """Rank 0's model raised before rank 0 reached `agree` (capturing it): rank 1 waited out the
    plan's wait (ten times timeout_s); now it reads rank 0's post and names the cause at once."""
    _, (kind, message, waited) = run_ranks(2, rank_0_fails_before_agreeing, timeout=50)
    assert kind == "ModelError" and "rank 0 raised ValueError: the forward found a NaN while capturing" in message
    assert "waiting for rank 0's layout plan" in message and waited < 10.0, (message, waited)
