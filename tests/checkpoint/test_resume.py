"""Tests for plait.checkpoint.resume: the data position a checkpoint saved, read back exactly, and
errors naming what changed since (no files: a Checkpoint is its path and meta)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.checkpoint.disk import Checkpoint
from plait.checkpoint.resume import ResumePoint, resume_point
from plait.errors import CheckpointError

ORDER = {"seed": 0, "shuffle": True, "batch_size": 5, "rows": 23}
DATA = {**ORDER, "epoch": 2, "batch": 3, "totals": [1.5, 4.0], "rows_seen": 15,
        "history_epochs": [0, 1], "history": {"loss": [0.9, 0.7], "accuracy": [0.5, 0.75]}}


def ckpt(data: object | None = None) -> Checkpoint:
    meta = {"step": 13, "shards": [], "tensors": {}}
    if data is not None:
        meta["data"] = data
    return Checkpoint(Path("/ckpt/step-000013"), meta)


def test_the_saved_position_comes_back() -> None:
    assert resume_point(ckpt(DATA), ORDER) == ResumePoint(
        epoch=2, batch=3, totals=[1.5, 4.0], rows_seen=15, history_epochs=[0, 1],
        history={"loss": [0.9, 0.7], "accuracy": [0.5, 0.75]})


def test_an_epoch_not_begun_has_no_totals_and_numbers_are_converted() -> None:
    point = resume_point(ckpt({**DATA, "totals": None, "epoch": 3.0, "batch": 0, "rows_seen": "0",
                               "history": {"loss": [1]}}), ORDER)
    assert point.totals is None and (point.epoch, point.batch, point.rows_seen) == (3, 0, 0)
    assert point.history == {"loss": [1.0]} and type(point.history["loss"][0]) is float


def test_a_checkpoint_saved_outside_fit_has_no_position() -> None:
    with pytest.raises(CheckpointError) as info:
        resume_point(ckpt(), ORDER)
    assert str(info.value) == (
        "/ckpt/step-000013 was saved outside fit (model.save), so it has no data position; load it with "
        "model.load() and fit without checkpoint_dir, or resume from a checkpoint fit saved")


def test_every_change_to_the_order_of_the_batches_is_named() -> None:
    with pytest.raises(CheckpointError) as info:
        resume_point(ckpt(DATA), {**ORDER, "shuffle": False, "batch_size": 10})
    assert str(info.value) == (
        "cannot resume /ckpt/step-000013: the batches would not come in the order they had when it was saved "
        "(shuffle: saved True, now False, batch_size: saved 5, now 10); resume with the same data, batch_size, "
        "shuffle and Config.seed, or start a new run in another checkpoint_dir")


def test_other_data_of_the_same_size_is_named_by_its_fingerprint() -> None:
    saved = {**DATA, "data_fingerprint": "0123456789abcdef"}
    with pytest.raises(CheckpointError, match=r"data_fingerprint: saved '0123456789abcdef', now 'fedcba9876543210'"):
        resume_point(ckpt(saved), {**ORDER, "data_fingerprint": "fedcba9876543210"})
    assert resume_point(ckpt(saved), {**ORDER, "data_fingerprint": "0123456789abcdef"}).epoch == 2


def test_a_checkpoint_without_a_fingerprint_resumes_on_its_order_alone() -> None:
    # checkpoints of an earlier plait saved no fingerprint: their order is still checked
    assert resume_point(ckpt(DATA), {**ORDER, "data_fingerprint": "fedcba9876543210"}).epoch == 2


def test_an_order_key_the_checkpoint_lacks_counts_as_changed() -> None:
    with pytest.raises(CheckpointError, match=r"\(dataset: saved None, now 'digits'\)"):
        resume_point(ckpt(DATA), {**ORDER, "dataset": "digits"})


@pytest.mark.parametrize("change, error", [
    ({"rows_seen": None}, "TypeError("),
    ({"history": [0.9]}, "AttributeError("),
    ({"epoch": "two"}, "ValueError("),
])
def test_a_malformed_position_is_named(change: dict, error: str) -> None:
    with pytest.raises(CheckpointError) as info:
        resume_point(ckpt({**DATA, **change}), ORDER)
    assert str(info.value).startswith(f"/ckpt/step-000013/meta.json: the data position is malformed ({error}")


def test_a_missing_field_is_named() -> None:
    data = dict(DATA)
    del data["history_epochs"]
    with pytest.raises(CheckpointError) as info:
        resume_point(ckpt(data), ORDER)
    assert str(info.value) == "/ckpt/step-000013/meta.json: the data position is malformed (KeyError('history_epochs'))"
