"""The user's `Config`: a frozen dataclass checked when it is made."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from plait.errors import ConfigError

__all__ = ["Config", "SCHEDULE_NAMES", "NONFINITE_ACTIONS"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zbh1")
NONFINITE_ACTIONS = ("stop", "skip", "ignore")


@dataclass(frozen=True)
class Config:
    """How to split and run the model.

    layers_per_proc: captured layers on each pipeline stage, in order (None: balanced automatically).
        With num_virtual_stages = v > 1 it lists every model chunk, num_stages x v entries.
    num_stages: pipeline stages, i.e. ranks per pipeline (None: the length of `layers_per_proc`
        divided by v, else the world size / dp).
    num_microbatches: micro-batches each global batch is cut into (clamped to the batch size).
    schedule: "gpipe", "1f1b", "interleaved" (Megatron's interleaved 1F1B: each rank holds
        num_virtual_stages non-adjacent model chunks) or "zbh1" (zero bubble ZB-H1: the backward
        split into input gradients, sent at once, and weight gradients, run in the bubbles).
    num_virtual_stages: model chunks per rank for schedule="interleaved" (1 otherwise).
    recompute: activation recomputation: True (every stage), False, "auto" (the stages that
        hold activations of more than one micro-batch at once under the schedule, where it
        saves memory) or a list of stage indices. A recomputed stage keeps only its inputs and
        runs its forward again during the backward.
    trace_dir: write each rank's measured timeline there as Chrome trace JSON (None: no trace).
    seed: seeds the shuffle order, identical on every rank.
    timeout_s: longest any wait on another rank may take before the run fails with a report.
    dp: data-parallel replicas of the pipeline; world size = dp x num_stages.
    grad_reduction: "mean" -- gradients of the global batch's mean loss, exactly what one process
        computes, even when the batch does not divide by dp -- or "sum": the sum over replicas of
        each replica's own mean-loss gradients.
    bucket_cap_mb: size of the gradient buckets all-reduced across replicas.
    checkpoint_dir: where `fit` saves checkpoints, and resumes from the latest one it finds
        there (None: no checkpoints). Every rank must see the same directory.
    checkpoint_every: training steps between checkpoints (None: at the end of every epoch).
    checkpoint_keep: complete checkpoints kept; older ones are deleted after a new one is complete.
    on_nonfinite: what a NaN or infinite loss or stage output in a training step does: "stop"
        (raise NonFiniteError naming the step and the first stage where it appeared, on every
        rank, before the optimizer step), "skip" (no optimizer step for that batch, on every
        rank) or "ignore" (no check at all).
    """

    layers_per_proc: tuple[int, ...] | None = None
    num_stages: int | None = None
    num_microbatches: int = 1
    schedule: str = "1f1b"
    num_virtual_stages: int = 1
    recompute: bool | str | tuple[int, ...] = False
    trace_dir: str | None = None
    seed: int = 0
    timeout_s: float = 300.0
    dp: int = 1
    grad_reduction: str = "mean"
    bucket_cap_mb: float = 25.0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int = 2
    on_nonfinite: str = "stop"

    def __post_init__(self) -> None:
        if self.layers_per_proc is not None:
            lpp = self.layers_per_proc
            if isinstance(lpp, (str, bytes)) or not hasattr(lpp, "__iter__"):
                raise ConfigError(
                    f"layers_per_proc must be a list of layer counts, one per stage, got {lpp!r}; "
                    "for example layers_per_proc=[2, 3, 3]"
                )
            counts = tuple(lpp)
            bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
            if not counts or bad:
                raise ConfigError(
                    f"layers_per_proc={list(counts)} must hold one positive integer per stage "
                    f"(bad entries: {bad}); every stage needs at least one layer"
                )
            object.__setattr__(self, "layers_per_proc", counts)
            v = self.num_virtual_stages if isinstance(self.num_virtual_stages, int) else 1
            if v > 1 and len(counts) % v:
                raise ConfigError(
                    f"layers_per_proc={list(counts)} has {len(counts)} entries, not a multiple of "
                    f"num_virtual_stages={v}; with interleaving it lists every model chunk "
                    f"(num_stages x {v} entries)"
                )
            if v > 1 and self.num_stages is not None and self.num_stages * v != len(counts):
                raise ConfigError(
                    f"num_stages={self.num_stages} x num_virtual_stages={v} = "
                    f"{self.num_stages * v} chunks but layers_per_proc={list(counts)} has "
                    f"{len(counts)} entries; make them agree"
                )
            if v == 1 and self.num_stages is not None and self.num_stages != len(counts):
                raise ConfigError(
                    f"num_stages={self.num_stages} but layers_per_proc={list(counts)} has "
                    f"{len(counts)} entries; give one of them, or make them agree"
                )
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise ConfigError(f"num_stages must be a positive integer or None, got {self.num_stages!r}")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ConfigError(
                f"num_microbatches must be a positive integer, got {self.num_microbatches!r}"
            )
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"schedule={self.schedule!r} is not known; choose one of {list(SCHEDULE_NAMES)}"
            )
        v = self.num_virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"num_virtual_stages must be a positive integer, got {v!r}")
        if v > 1 and self.schedule != "interleaved":
            raise ConfigError(
                f"num_virtual_stages={v} needs schedule='interleaved', got schedule={self.schedule!r}"
            )
        self._check_recompute()
        if self.trace_dir is not None and not isinstance(self.trace_dir, (str, bytes)) and not hasattr(
            self.trace_dir, "__fspath__"
        ):
            raise ConfigError(f"trace_dir must be a directory path or None, got {self.trace_dir!r}")
        if self.trace_dir is not None:
            object.__setattr__(self, "trace_dir", str(self.trace_dir))
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ConfigError(f"dp must be a positive integer (data-parallel replicas), got {self.dp!r}")
        if self.grad_reduction not in ("mean", "sum"):
            raise ConfigError(
                f"grad_reduction={self.grad_reduction!r} is not known; choose 'mean' or 'sum'"
            )
        if not (_is_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ConfigError(f"bucket_cap_mb must be a positive number, got {self.bucket_cap_mb!r}")
        if not (_is_number(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer (it seeds the shuffle order), got {self.seed!r}")
        self._check_checkpoints()

    def _check_checkpoints(self) -> None:
        d = self.checkpoint_dir
        if d is not None and not isinstance(d, str) and not hasattr(d, "__fspath__"):
            raise ConfigError(f"checkpoint_dir must be a directory path or None, got {d!r}")
        if d is not None:
            object.__setattr__(self, "checkpoint_dir", str(d))
        every = self.checkpoint_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ConfigError(
                f"checkpoint_every must be a positive number of steps or None (every epoch), got {every!r}"
            )
        keep = self.checkpoint_keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"checkpoint_keep must be a positive integer (2 keeps a fallback), got {keep!r}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ConfigError(
                f"on_nonfinite={self.on_nonfinite!r} is not known; choose one of {list(NONFINITE_ACTIONS)}"
            )

    def _check_recompute(self) -> None:
        r = self.recompute
        if isinstance(r, bool) or r == "auto":
            return
        if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
            raise ConfigError(
                f"recompute={r!r} is not known; use True, False, 'auto' or a list of stage indices"
            )
        stages = tuple(r)
        bad = [s for s in stages if not isinstance(s, int) or isinstance(s, bool) or s < 0]
        if bad:
            raise ConfigError(
                f"recompute={list(stages)} must list stage indices >= 0 (bad entries: {bad})"
            )
        object.__setattr__(self, "recompute", stages)

    def stages_for(self, world_size: int) -> int:
        """Pipeline stages (ranks per pipeline) on `world_size` ranks; world size must be dp x stages."""
        if self.layers_per_proc is not None:
            stages: int | None = len(self.layers_per_proc) // self.num_virtual_stages
        else:
            stages = self.num_stages
        if stages is None:
            if world_size % self.dp:
                raise ConfigError(
                    f"world size {world_size} does not divide by dp={self.dp}; launch a multiple "
                    f"of {self.dp} ranks, or set dp to a factor of {world_size}"
                )
            return world_size // self.dp
        if stages * self.dp != world_size:
            lpp = None if self.layers_per_proc is None else list(self.layers_per_proc)
            raise ConfigError(
                f"the config asks for {stages} pipeline stages x dp={self.dp} replicas = "
                f"{stages * self.dp} ranks (layers_per_proc={lpp}, num_stages={self.num_stages}, "
                f"dp={self.dp}) but the world size is {world_size}; launch "
                f"{stages * self.dp} ranks (plait run -n {stages * self.dp} ...) or change the config"
            )
        return stages

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values."""
        d = asdict(self)
        if d["layers_per_proc"] is not None:
            d["layers_per_proc"] = list(d["layers_per_proc"])
        if isinstance(d["recompute"], tuple):
            d["recompute"] = list(d["recompute"])
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "Config":
        """The Config of `to_dict()` output (unknown names are an error; missing ones default)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a Config is a JSON object of its fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(f"unknown Config fields {unknown}; known: {sorted(known)}")
        values = dict(data)
        for name in ("layers_per_proc", "recompute"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong type deep inside a check
            raise ConfigError(f"not a valid Config ({type(e).__name__}: {e}); expected Config.to_dict() output") from None

    def to_json(self) -> str:
        """The fields as a JSON object."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Config":
        """The Config of `to_json()` output; anything else raises ConfigError."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"not a plait Config: not JSON ({type(e).__name__}: {e})") from None
        return cls.from_dict(data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
