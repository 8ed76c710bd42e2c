"""Tests for plait.callbacks: the progress bar's lines and the history."""

from __future__ import annotations

import io
import re

import pytest

from plait.callbacks import Callback, History, PlanPrinter, ProgressBar, call_hooks


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_epochs(cb: Callback, epochs: int, steps: int) -> None:
    """Drive a callback the way Model.fit does: 0-based epochs and steps, running-mean batch logs."""
    for epoch in range(epochs):
        cb.on_epoch_begin(epoch, {})
        for step in range(steps):
            cb.on_batch_end(step, {"loss": 1.0 / (step + 1)})
        cb.on_epoch_end(epoch, {"loss": 0.25 * (epoch + 1), "accuracy": 0.5})


def test_progress_bar_one_line_per_epoch_off_a_terminal() -> None:
    out = io.StringIO()
    run_epochs(ProgressBar(steps_per_epoch=8, epochs=2, stream=out), epochs=2, steps=8)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert re.fullmatch(r"Epoch 1/2 \[={30}\] 8/8 - loss: 0\.2500 - accuracy: 0\.5000 - \d+\.\ds", lines[0])
    assert lines[1].startswith("Epoch 2/2 [")
    assert "loss: 0.5000" in lines[1]


def test_progress_bar_redraws_on_a_terminal() -> None:
    out = FakeTTY()
    bar = ProgressBar(steps_per_epoch=8, epochs=5, stream=out, width=10)
    bar.on_epoch_begin(2, {})
    for step in range(6):
        bar.on_batch_end(step, {"loss": 0.4321})
    text = out.getvalue()
    assert text.count("\r") == 6 and "\n" not in text
    last = text.split("\r")[-1]
    assert re.fullmatch(r"Epoch 3/5 \[======>\.\.\.\] 6/8 - loss: 0\.4321 - \d+\.\ds", last)
    bar.on_batch_end(6, {"loss": 0.4})
    bar.on_batch_end(7, {"loss": 0.3})
    bar.on_epoch_end(2, {"loss": 0.3})
    assert out.getvalue().endswith("\n")
    assert "[==========] 8/8 - loss: 0.3000" in out.getvalue().split("\r")[-1]


def test_progress_bar_head_at_start() -> None:
    bar = ProgressBar(steps_per_epoch=8, epochs=1, width=8)
    assert bar.format_line(0, {}).startswith("Epoch 1/1 [>.......] 0/8 - ")
    assert bar.format_line(1, {}).startswith("Epoch 1/1 [>.......] 1/8 - ")
    assert bar.format_line(4, {}).startswith("Epoch 1/1 [===>....] 4/8 - ")


def test_progress_bar_disabled_prints_nothing() -> None:
    for out in (io.StringIO(), FakeTTY()):
        run_epochs(ProgressBar(steps_per_epoch=3, epochs=2, enabled=False, stream=out), epochs=2, steps=3)
        assert out.getvalue() == ""


def test_progress_bar_rejects_empty_sizes() -> None:
    with pytest.raises(ValueError, match="steps_per_epoch: 0"):
        ProgressBar(steps_per_epoch=0, epochs=1)


def test_history_collects_epoch_logs() -> None:
    history = History()
    run_epochs(history, epochs=3, steps=2)
    assert history.epoch == [0, 1, 2]
    assert history.history == {"loss": [0.25, 0.5, 0.75], "accuracy": [0.5, 0.5, 0.5]}


def test_callback_base_is_a_no_op() -> None:
    run_epochs(Callback(), epochs=1, steps=2)


class _Report:
    def __init__(self, feedback=None):
        self.feedback = feedback

    def __str__(self) -> str:
        return "the planner's table"


class _Feedback:
    def summary(self) -> str:
        return "measured against predicted"


def test_plan_printer_prints_the_plan_once_then_the_check_once(capsys) -> None:
    state = {"report": _Report()}
    printer = PlanPrinter(lambda: ("the plan", state["report"]))
    printer.on_batch_end(0)
    printer.on_batch_end(1)
    assert capsys.readouterr().out.splitlines() == ["the plan", "the planner's table"]
    state["report"] = _Report(_Feedback())  # the closed loop has measured
    printer.on_batch_end(2)
    printer.on_batch_end(3)
    assert capsys.readouterr().out.splitlines() == ["measured against predicted"]


def test_plan_printer_without_a_report_and_when_disabled(capsys) -> None:
    PlanPrinter(lambda: ("the plan", None)).on_batch_end(0)
    assert capsys.readouterr().out == "the plan\n"
    PlanPrinter(lambda: ("the plan", None), enabled=False).on_batch_end(0)
    assert capsys.readouterr().out == ""


def test_call_hooks_calls_the_callbacks_that_have_the_hook_in_order() -> None:
    calls = []

    class Some:
        def on_epoch_end(self, epoch, logs):
            calls.append(("some", epoch, logs))

    class Other:  # no on_epoch_end: skipped, as Keras does for callbacks without the hook
        pass

    call_hooks([Some(), Other(), Some()], "on_epoch_end", 3, {"loss": 1.0})
    assert calls == [("some", 3, {"loss": 1.0})] * 2
