"""Tests for plait.runtime.step's optimizer making: a rank whose stages hold no parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.errors import ConfigError
from plait.runtime.step import make_optimizer


def test_a_rank_without_parameters_gets_an_optimizer_that_changes_nothing() -> None:
    for build in (lambda p: torch.optim.Adam(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        opt = make_optimizer(build, [])
        assert opt is not None and [len(g["params"]) for g in opt.param_groups] == [0]
        opt.step()
        assert opt.state_dict()["state"] == {}


def test_the_users_callable_gets_the_parameters() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = make_optimizer(lambda p: torch.optim.SGD(p, lr=0.5), [w])
    assert opt is not None and opt.param_groups[0]["params"] == [w]
    given = torch.optim.SGD([w], lr=0.1)
    assert make_optimizer(given, [w]) is given and make_optimizer(None, [w]) is None
    with pytest.raises(ConfigError, match="optimizer must be a torch.optim.Optimizer or a callable"):
        make_optimizer("adam", [w])  # type: ignore[arg-type]


def test_zero3_takes_the_optimizer_as_a_callable_over_its_shards() -> None:
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ConfigError, match="zero=3 steps each rank's shards.*pass a callable"):
        make_optimizer(torch.optim.SGD([w], lr=0.1), [w], sharded=True)
    assert isinstance(make_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), [w], sharded=True), torch.optim.SGD)
