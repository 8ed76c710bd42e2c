"""Tests for plait.metrics: the prediction found in any output form, accuracy as counts that add up
over batches, and the logs made of summed statistics."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from plait.errors import ConfigError
from plait.metrics import METRICS, check_metrics, logits_of, logs_of

LOGITS = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])  # predicts 1, 0, 1


@dataclass
class Output:
    loss: torch.Tensor
    hidden: torch.Tensor


class WithLogits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


@pytest.mark.parametrize("output", [
    LOGITS,
    {"logits": LOGITS, "aux": torch.zeros(1)},
    {"scores": LOGITS, "aux": torch.zeros(1)},  # no "logits": the first value
    WithLogits(LOGITS),
    Output(LOGITS, torch.zeros(1)),  # a dataclass: its first field
    (LOGITS, torch.zeros(1)),
    [[LOGITS]],
    namedtuple("Pair", "a b")(LOGITS, None),
    {"logits": (LOGITS,)},
], ids=["tensor", "dict logits", "dict first", "attribute", "dataclass", "tuple", "nested list",
        "namedtuple", "dict of tuple"])
def test_logits_of_finds_the_prediction_tensor(output: object) -> None:
    assert logits_of(output) is LOGITS


@pytest.mark.parametrize("output, kind", [(None, "NoneType"), ((), "tuple"), (3.5, "float")])
def test_logits_of_names_an_output_without_a_tensor(output: object, kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        logits_of(output)
    assert str(info.value) == f"cannot find a prediction tensor in a model output of type {kind}"


def test_accuracy_counts_correct_and_counted() -> None:
    accuracy = METRICS["accuracy"]
    assert accuracy(LOGITS, torch.tensor([1, 1, 1])) == (2.0, 3.0)
    assert accuracy({"logits": LOGITS}, torch.tensor([0, 0, 0])) == (1.0, 3.0)
    one_hot = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # targets 1, 0, 0
    assert accuracy(LOGITS, one_hot) == (2.0, 3.0)
    tokens = torch.randn(2, 5, 7)  # (B, T, vocab): every token counts
    assert accuracy(tokens, tokens.argmax(-1)) == (10.0, 10.0)


def test_accuracy_adds_up_over_batches() -> None:
    accuracy = METRICS["accuracy"]
    target = torch.tensor([1, 0, 0])
    whole = accuracy(LOGITS, target)
    parts = [accuracy(LOGITS[:1], target[:1]), accuracy(LOGITS[1:], target[1:])]
    assert whole == (sum(p[0] for p in parts), sum(p[1] for p in parts)) == (2.0, 3.0)


def test_check_metrics() -> None:
    assert check_metrics(None) == [] and check_metrics(()) == []
    assert check_metrics(("accuracy",)) == ["accuracy"]
    with pytest.raises(ConfigError) as info:
        check_metrics(["accuracy", "f1", "auc"])
    assert str(info.value) == "unknown metrics ['f1', 'auc']; plait knows ['accuracy']"


def test_logs_of_summed_statistics() -> None:
    # loss summed as loss x rows over 8 rows; accuracy 6 correct of 8
    assert logs_of(["accuracy"], [4.0, 6.0, 8.0], 8) == {"loss": 0.5, "accuracy": 0.75}
    assert logs_of([], [3.0], 4) == {"loss": 0.75}
    assert logs_of(["accuracy"], [0.0, 0.0, 0.0], 1) == {"loss": 0.0, "accuracy": 0.0}  # nothing counted
