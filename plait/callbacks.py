"""Training callbacks: the progress bar, the history, and the plan printed after the first step."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, TextIO

__all__ = ["Callback", "ProgressBar", "History", "PlanPrinter", "call_hooks"]

Logs = dict[str, float]


class Callback:
    """Hooks that `Model.fit` calls; every hook is a no-op here.

    Indices are 0-based, as in Keras: `epoch` counts epochs of this `fit`, `step` counts
    batches within the current epoch. `logs` maps metric names to floats: the batch's
    values in `on_batch_end`, the epoch's in `on_epoch_end`.
    """

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        pass

    def on_batch_end(self, step: int, logs: Logs | None = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        pass


class ProgressBar(Callback):
    """A Keras-like progress line, printed by one rank only (pass `enabled=False` elsewhere).

        Epoch 3/5 [==================>...........] 5/8 - loss: 0.4321 - 1.2s

    On a terminal the line is redrawn after every batch (carriage return) and ends with a
    newline at the end of the epoch. Anywhere else (a log file, CI) it is written once per
    epoch, so logs stay one line per epoch. The bar shows the latest logs as given: as in
    Keras, `Model.fit` passes the running mean over the epoch so far to `on_batch_end`, and
    the epoch's values to `on_epoch_end`.
    """

    def __init__(
        self,
        steps_per_epoch: int,
        epochs: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 30,
    ) -> None:
        if steps_per_epoch < 1 or epochs < 1 or width < 1:
            raise ValueError(
                f"ProgressBar needs positive sizes (steps_per_epoch: {steps_per_epoch}, "
                f"epochs: {epochs}, width: {width})"
            )
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._epoch = 0
        self._steps_done = 0
        self._logs: Logs = {}
        self._start = time.perf_counter()

    def _is_tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch
        self._steps_done = 0
        self._logs = {}
        self._start = time.perf_counter()

    def on_batch_end(self, step: int, logs: Logs | None = None) -> None:
        self._steps_done = step + 1
        self._logs = dict(logs or {})
        if self.enabled and self._is_tty():
            self.stream.write("\r" + self.format_line(self._steps_done, self._logs))
            self.stream.flush()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.enabled:
            return
        shown = dict(logs) if logs else self._logs
        prefix = "\r" if self._is_tty() else ""
        self.stream.write(prefix + self.format_line(self._steps_done, shown) + "\n")
        self.stream.flush()

    def format_line(self, steps_done: int, logs: Logs) -> str:
        """The progress line for `steps_done` batches of the current epoch (no newline)."""
        total = self.steps_per_epoch
        steps_done = min(steps_done, total)
        filled = self.width * steps_done // total
        if steps_done < total:
            # Keras draws the head as '>' while the epoch runs: "[=====>....]".
            bar = "=" * max(0, filled - 1) + ">" + "." * (self.width - max(1, filled))
        else:
            bar = "=" * self.width
        digits = len(str(total))
        parts = [f"Epoch {self._epoch + 1}/{self.epochs} [{bar}] {steps_done:>{digits}}/{total}"]
        parts += [f"{name}: {value:.4f}" for name, value in logs.items()]
        parts.append(f"{time.perf_counter() - self._start:.1f}s")
        return " - ".join(parts)


class History(Callback):
    """Collects each epoch's logs: `history.history["loss"][e]` is epoch e's loss."""

    def __init__(self) -> None:
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(float(value))

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"


class PlanPrinter(Callback):
    """Prints the plan and the planner's report after the first step, and the plan check once
    it has measured; `describe()` gives (the plan, the report or None) as they are now."""

    def __init__(self, describe: Callable[[], tuple[Any, Any]], enabled: bool = True) -> None:
        self.describe, self.enabled = describe, enabled
        self.shown: set[str] = set()

    def on_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if not self.enabled:
            return
        plan, report = self.describe()
        if "plan" not in self.shown:
            print(plan, flush=True)
            if report is not None:
                print(report, flush=True)
            self.shown.add("plan")
        if "check" not in self.shown and report is not None and report.feedback is not None:
            print(report.feedback.summary(), flush=True)
            self.shown.add("check")


def call_hooks(callbacks: Iterable[Any], hook: str, *args: Any) -> None:
    """Call `hook` on every callback that has it (a callback need not subclass Callback)."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)
