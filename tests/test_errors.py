"""Tests for plait.errors: one base class, and the built-in class each error also is, so that
`except ValueError` around a user's own code still catches plait's value errors."""

from __future__ import annotations

import pytest

import plait
from plait import errors

# name -> the classes it derives from directly, in order
BASES = {
    "PlaitError": (Exception,),
    "ConfigError": (errors.PlaitError, ValueError),
    "CaptureError": (errors.PlaitError,),
    "PartitionError": (errors.PlaitError, ValueError),
    "ScheduleError": (errors.PlaitError,),
    "LossError": (errors.PlaitError, ValueError),
    "PipelineError": (errors.PlaitError, RuntimeError),
    "CheckpointError": (errors.PlaitError,),
    "NonFiniteError": (errors.PlaitError, FloatingPointError),
    "ModelError": (errors.PlaitError, RuntimeError),
}


def test_every_error_and_its_bases() -> None:
    assert sorted(errors.__all__) == sorted(BASES)
    for name, bases in BASES.items():
        assert getattr(errors, name).__bases__ == bases, name


def test_the_package_exports_the_same_classes() -> None:
    for name in errors.__all__:
        assert getattr(plait, name) is getattr(errors, name), name
        assert name in plait.__all__, name


@pytest.mark.parametrize("name", sorted(BASES))
def test_each_error_says_when_it_is_raised_and_keeps_its_message(name: str) -> None:
    cls = getattr(errors, name)
    assert cls.__doc__ is not None and cls.__doc__.strip().endswith("."), name
    error = cls("num_stages=3 but the world size is 2")
    assert str(error) == "num_stages=3 but the world size is 2"
    with pytest.raises(errors.PlaitError, match="^num_stages=3 but the world size is 2$"):
        raise error


def test_value_errors_are_caught_as_value_errors_and_the_others_are_not() -> None:
    value_errors = {n for n in BASES if issubclass(getattr(errors, n), ValueError)}
    assert value_errors == {"ConfigError", "PartitionError", "LossError"}
    with pytest.raises(ValueError):
        raise errors.ConfigError("bad")
    assert not issubclass(errors.CheckpointError, (ValueError, RuntimeError, OSError))
    assert issubclass(errors.NonFiniteError, ArithmeticError)  # FloatingPointError's own base
