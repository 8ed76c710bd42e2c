"""Tests for plait.capture.output: model outputs flattened into graph leaves and built back, exactly."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from plait.capture.output import flatten_output, unflatten_output

A, B, C = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
Pair = namedtuple("Pair", "first second")


@dataclass
class Output:
    logits: torch.Tensor
    loss: Any = None


def test_a_tensor_is_one_leaf_and_plain_values_are_constants() -> None:
    assert flatten_output(A) == ([A], ("leaf",))
    for value in (None, True, 3, 2.5, "mean"):
        assert flatten_output(value) == ([], ("const", value))


def test_the_spec_of_a_nested_output() -> None:
    leaves, spec = flatten_output({"logits": A, "aux": (B, None, [C])})
    assert leaves == [A, B, C]  # depth first, in key and item order
    assert spec == ("map", dict, ("logits", "aux"), (
        ("leaf",),
        ("seq", tuple, (("leaf",), ("const", None), ("seq", list, (("leaf",),)))),
    ))


def test_a_dataclass_keeps_its_field_names() -> None:
    leaves, spec = flatten_output(Output(A, loss=0.5))
    assert leaves == [A] and spec == ("dataclass", Output, ("logits", "loss"), (("leaf",), ("const", 0.5)))


@pytest.mark.parametrize("output", [
    A, (A, B), [A, (B, C)], {"a": A, "b": {"c": B}}, OrderedDict(b=B, a=A), Pair(A, B),
    Output(A, B), Output(A), (None, "text", 3, A), {"logits": Output(A, [B, C])}, (), {},
], ids=["tensor", "tuple", "list", "dict", "ordered dict", "namedtuple", "dataclass", "dataclass default",
        "constants", "nested", "empty tuple", "empty dict"])
def test_unflatten_builds_the_same_output_of_the_same_types(output: Any) -> None:
    leaves, spec = flatten_output(output)
    rebuilt = unflatten_output(leaves, spec)
    assert type(rebuilt) is type(output)
    assert _same(rebuilt, output)


def test_unflatten_puts_new_leaves_where_the_old_ones_were() -> None:
    _, spec = flatten_output({"x": Pair(A, None), "y": [B]})
    got = unflatten_output([C, A], spec)
    assert type(got["x"]) is Pair and got["x"].first is C and got["x"].second is None
    assert got["y"][0] is A


def test_an_output_plait_cannot_carry_is_named() -> None:
    with pytest.raises(TypeError) as info:
        flatten_output((A, {1, 2}))
    assert str(info.value) == ("plait cannot carry a model output of type set; return tensors, tuples, lists, "
                               "dicts or dataclasses of them")


def test_a_key_value_cache_output_says_to_turn_the_cache_off() -> None:
    class DynamicCache:  # what a Hugging Face decoder returns with config.use_cache=True
        pass

    with pytest.raises(TypeError, match=r"type DynamicCache \(a Hugging Face key/value cache: build the model "
                                        r"with config.use_cache=False for training\)"):
        flatten_output({"logits": A, "past_key_values": DynamicCache()})


def test_an_unknown_spec_kind_is_an_internal_error() -> None:
    with pytest.raises(AssertionError, match="unknown output spec kind 'tree'"):
        unflatten_output([], ("tree",))


def _same(a: Any, b: Any) -> bool:
    """Equal structure with the very same tensors (identity, not values)."""
    if isinstance(b, torch.Tensor):
        return a is b
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, Output):
        return _same(a.logits, b.logits) and _same(a.loss, b.loss)
    return bool(a == b)
