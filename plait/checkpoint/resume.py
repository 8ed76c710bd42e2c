"""Where a resumed `fit` starts: the data position a checkpoint saved, checked against this fit's data.

The batches of an epoch are a function of the data, batch_size, shuffle and Config.seed (the
shuffle order is seeded by seed and epoch), so a position is just (epoch, batches of it done):
the resumed fit re-makes that epoch's order and skips the batches already trained on. The
epoch's running loss sums and the History so far come back with it, so the logs are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.checkpoint.disk import Checkpoint
from plait.errors import CheckpointError

__all__ = ["ResumePoint", "resume_point", "resumed_line"]


@dataclass(frozen=True)
class ResumePoint:
    """The epoch to resume, the batches of it already done, and the logs carried over."""

    epoch: int
    batch: int
    totals: list[float] | None  # the epoch's running sums (None: the epoch had not begun)
    rows_seen: int
    history_epochs: list[int]
    history: dict[str, list[float]]


def resume_point(ckpt: Checkpoint, order: dict[str, Any]) -> ResumePoint:
    """The point to resume at; `order` (seed, shuffle, batch_size, rows...) must be as when saved."""
    data = ckpt.meta.get("data")
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{ckpt.path} was saved outside fit (model.save), so it has no data position; load it "
            f"with model.load() and fit without checkpoint_dir, or resume from a checkpoint fit saved"
        )
    # (a checkpoint of an earlier plait has no data fingerprint: only the order is checked)
    changed = {k: (data.get(k), v) for k, v in order.items()
               if data.get(k) != v and (k in data or k != "data_fingerprint")}
    if changed:
        text = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise CheckpointError(
            f"cannot resume {ckpt.path}: the batches would not come in the order they had when it "
            f"was saved ({text}); resume with the same data, batch_size, shuffle and Config.seed, "
            f"or start a new run in another checkpoint_dir"
        )
    try:
        totals = data["totals"]
        return ResumePoint(
            epoch=int(data["epoch"]), batch=int(data["batch"]),
            totals=None if totals is None else [float(t) for t in totals],
            rows_seen=int(data["rows_seen"]),
            history_epochs=[int(e) for e in data["history_epochs"]],
            history={str(k): [float(v) for v in vs] for k, vs in data["history"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{ckpt.path}/meta.json: the data position is malformed ({e!r})") from None


def resumed_line(ckpt: Checkpoint, start: ResumePoint, epochs: int) -> str:
    """What a resumed fit says (a run with nothing left to do must not look like one that trained)."""
    left = (f"nothing is left to do: the {epochs} epochs asked for are done (ask for more epochs, or give "
            "another checkpoint_dir to train again)" if start.epoch >= epochs else
            f"going on at epoch {start.epoch + 1} of {epochs}, batch {start.batch + 1}")
    return f"plait: resumed from step {ckpt.step} of {ckpt.path}; {left}"
