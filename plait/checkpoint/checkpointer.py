"""`Checkpointer`: saving and choosing checkpoints together, on every rank of the job.

    save:   every rank writes its shard durably          (checkpoint.write_shard)
            all ranks exchange (ok, size, sha256)        one small all-reduce
            rank 0 commits: meta.json, rename, `latest`  (checkpoint.commit)
            all ranks learn whether rank 0 committed     one small all-reduce: save returns on
                                                         every rank once the checkpoint is complete
    choose: rank 0 verifies and picks (the latest, else the previous complete one) and tells
            every rank which step, so all load the same checkpoint.

Only numbers cross the wire (float64 sums, each value below 2**53: no pickle). A rank that dies
meanwhile makes the others' collective fail; they raise a PipelineError naming the silent rank.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Callable

from plait.checkpoint import disk as checkpoint
from plait.errors import CheckpointError, PlaitError
from plait.runtime.comm.collectives import sum_floats
from plait.runtime.failure import failure_error

__all__ = ["Checkpointer"]

log = logging.getLogger("plait")

_ROW = 10  # ok, size, sha256 as 8 words of 32 bits


class Checkpointer:
    """Saves and chooses checkpoints for one rank, in step with the others."""

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._token: str | None = None

    def _sum(self, values: list[float], what: str) -> list[float]:
        try:
            return sum_floats(values)
        except PlaitError:
            raise
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: name it
            raise failure_error(what, self.rank, e, self.timeout_s) from e

    def _only_rank0(self, value: float) -> float:
        """`value` as rank 0 has it, on every rank."""
        return self._sum([value if self.rank == 0 else 0.0], "agreeing on a checkpoint")[0]

    def token(self) -> str:
        """A name part every rank of this job incarnation shares (temp directories use it)."""
        if self._token is None:
            self._token = f"{int(self._only_rank0(float(random.SystemRandom().getrandbits(48)))):012x}"
        return self._token

    def save(self, root: str | os.PathLike[str], step: int, tensors: dict[str, Any],
             metadata: dict[str, str], meta: Callable[[], dict[str, Any]], keep: int) -> Path:
        """Write this rank's shard of step `step`; rank 0 commits it once every shard is durable."""
        temp = checkpoint.temp_dir(root, step, self.token())
        row = [0.0] * _ROW
        error: BaseException | None = None
        try:
            size, digest = checkpoint.write_shard(temp, self.rank, tensors, metadata)
            row = [1.0, float(size), *(float(int(digest[i:i + 8], 16)) for i in range(0, 64, 8))]
        except Exception as e:  # noqa: BLE001 - the others must hear of it, not wait for this rank
            error = e
        mine = [0.0] * (_ROW * self.world_size)
        mine[_ROW * self.rank : _ROW * (self.rank + 1)] = row
        rows = self._sum(mine, f"saving checkpoint step {step}")
        shards = []
        for r in range(self.world_size):
            ok, nbytes, *words = rows[_ROW * r : _ROW * (r + 1)]  # floats: each below 2**53, exact
            shards.append({"file": f"rank{r}.safetensors", "bytes": int(nbytes),
                           "sha256": "".join(f"{int(w):08x}" for w in words), "ok": ok == 1.0})
        failed = [r for r, s in enumerate(shards) if not s.pop("ok")]
        if failed:
            why = f"; this rank: {type(error).__name__}: {error}" if error is not None else ""
            raise CheckpointError(
                f"checkpoint step {step} was not saved: ranks {failed} could not write their shard "
                f"into {temp}{why}. Check that the directory is writable by every rank and has room; "
                f"the previous checkpoint is still the latest"
            )
        committed = 0.0
        if self.rank == 0:
            try:
                checkpoint.commit(root, temp, step, {**meta(), "shards": shards}, keep)
                committed = 1.0
            except Exception as e:  # noqa: BLE001 - the others wait for the outcome
                error = e
                log.error("plait: rank 0 could not commit checkpoint step %d in %s: %s", step, root, e)
        if self._only_rank0(committed) != 1.0:
            raise CheckpointError(
                f"rank 0 could not commit checkpoint step {step} in {root}"
                f"{f': {error}' if error is not None else ' (see its error)'}; the previous "
                f"checkpoint is still the latest"
            )
        return Path(root) / checkpoint.step_name(step)

    def choose(self, path: str | os.PathLike[str]) -> checkpoint.Checkpoint | None:
        """The checkpoint to load from `path`, the same on every rank; None if there is none.

        `path` is a step directory (it must be complete) or a checkpoint directory (its latest
        complete checkpoint, falling back to the previous one if the latest is damaged).
        """
        path = Path(path)
        explicit = (path / "meta.json").exists()
        found: checkpoint.Checkpoint | None = None
        error: BaseException | None = None
        code = -1.0
        if self.rank == 0:
            try:
                found = checkpoint.open_checkpoint(path, verify=True) if explicit else checkpoint.find_resumable(path)
                code = float(found.step) if found is not None else -1.0
            except Exception as e:  # noqa: BLE001 - every rank must hear the outcome
                error, code = e, -2.0
        code = self._only_rank0(code)
        if code == -2.0:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"rank 0 could not read the checkpoint at {path}"
                                  f"{f': {type(error).__name__}: {error}' if error else ' (see its error)'}")
        if code == -1.0:
            return None
        if found is not None:
            return found
        return checkpoint.open_checkpoint(path if explicit else path / checkpoint.step_name(int(code)))
