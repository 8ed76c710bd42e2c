"""Tests for plait.runtime.update.loss_scale: GradScaler's update rule, unscaling, the overflow check and the saved state."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.update.loss_scale import LossScale


def test_the_scale_follows_gradscalers_own_update_step_for_step():
    ours = LossScale(scale=2.0**10, growth_interval=3)
    scale, tracker = torch.tensor([2.0**10]), torch.tensor([0], dtype=torch.int32)
    for found in [False, False, False, True, False, False, False, False, True, True, False]:
        ours.update(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor([1.0 if found else 0.0]), 2.0, 0.5, 3)
        assert (ours.scale, ours.growth_tracker) == (float(scale), int(tracker))
    assert ours.skipped_steps == 3


def test_unscale_and_the_overflow_check_on_one_rank():
    grads = [torch.full((3,), 8.0), None, torch.tensor([2.0, 4.0])]
    ours = LossScale(scale=4.0)
    assert not ours.found_nonfinite(grads, world_size=1)
    ours.unscale(grads)
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[2], torch.tensor([0.5, 1.0]))
    assert ours.found_nonfinite([torch.tensor([1.0, float("inf")])], world_size=1)
    assert ours.found_nonfinite([torch.tensor([float("nan")])], world_size=1)


def test_the_state_round_trips_and_a_bad_one_is_refused():
    ours = LossScale(scale=512.0, growth_tracker=7)
    again = LossScale()
    again.load_state_dict(ours.state_dict())
    assert (again.scale, again.growth_tracker) == (512.0, 7)
    with pytest.raises(ValueError, match="loss scale"):
        again.load_state_dict({"scale": float("inf"), "growth_tracker": 0})
