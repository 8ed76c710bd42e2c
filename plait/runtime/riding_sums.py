"""`RidingSums`: a training step's loss sums and non-finite flags, carried on the pipeline's own messages.

In a pipeline of one rank per stage (no data or tensor parallelism) the step's sums need no
collective of their own. Each stage's vector (its non-finite flag; the last stage's also holds
the loss and metric sums and the loss's flag) rides forward on the activations of the stage's
last forward, added to what the stages before it sent; the last stage then holds the total, which
rides back on the input gradients of each stage's last backward:

    stage 0 --F(last) + [v0]--> stage 1 --F(last) + [v0+v1]--> stage 2: total = v0+v1+v2
    stage 0 <--B(last) + [total]-- stage 1 <--B(last) + [total]-- stage 2

Every entry of the vector comes from one stage alone (the others add zeros), so the total is the
all-reduce's, bit for bit, and every rank reads the same total. The messages' small tensors
travel in one buffer (`plait.runtime.comm.packing`): the vector costs no message of its own, where the
all-reduce it replaces cost a two-rank CPU pipeline several percent of its step
(docs/benchmarks.md, "The step's sums on the pipeline's messages").

Stage s's last forward comes before its last SF carries the vector on; stage s+1 receives it on
the RF of that micro-batch, which precedes its own last forward. Backward alike: the last B of
stage s+1 sends the total, which stage s receives before its own last B.
"""

from __future__ import annotations

from typing import Callable

import torch

from plait.schedule import Op, Program

__all__ = ["RidingSums", "carriers"]


def carriers(program: Program) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage, the micro-batch of its last forward and of its last backward in `program`."""
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for actions in program.values():
        for a in actions:
            if a.op is Op.FORWARD:
                forward[a.stage_index] = a.microbatch_index
            elif a.op is Op.BACKWARD:
                backward[a.stage_index] = a.microbatch_index
    return forward, backward


class RidingSums:
    """One step's sums on one rank: what its stages add, and the total once it has come by."""

    def __init__(self, carried: tuple[dict[int, int], dict[int, int]], num_chunks: int, length: int,
                 own: Callable[[int], list[float]], device: torch.device) -> None:
        self.last_forward, self.last_backward = carried
        self.num_chunks, self.length, self.own, self.device = num_chunks, length, own, device
        self._received: dict[int, torch.Tensor] = {}  # stage -> the vector of the stages before it
        self._after: dict[int, torch.Tensor] = {}  # stage -> the vector it passes on
        self.total: torch.Tensor | None = None

    @property
    def spec(self) -> tuple[torch.dtype, tuple[int, ...]]:
        """The (dtype, shape) of the vector, as the wire lays it out."""
        return torch.float64, (self.length,)

    def like(self) -> torch.Tensor:
        """An empty tensor shaped as the vector (what a receive of it is laid out by)."""
        return torch.empty(self.length, dtype=torch.float64)

    def rides_forward(self, stage_index: int, microbatch_index: int) -> bool:
        """Whether the activations stage `stage_index` sends for this micro-batch carry the vector."""
        return self.last_forward.get(stage_index) == microbatch_index and stage_index < self.num_chunks - 1

    def rides_backward(self, stage_index: int, microbatch_index: int) -> bool:
        """Whether the input gradients stage `stage_index` sends back for this micro-batch carry the total."""
        return self.last_backward.get(stage_index) == microbatch_index and stage_index > 0

    def forward_done(self, stage_index: int, microbatch_index: int) -> None:
        """After a forward: at the stage's last one, add its own vector to what came before it."""
        if self.last_forward.get(stage_index) != microbatch_index:
            return
        before = self._received.pop(stage_index, None) if stage_index else None
        if stage_index and before is None:  # pragma: no cover - the carriers above make this impossible
            raise AssertionError(f"stage {stage_index}'s last forward ran before the sums of the stages before it came")
        mine = torch.tensor(self.own(stage_index), dtype=torch.float64, device=self.device)
        after = mine if before is None else before + mine
        if stage_index == self.num_chunks - 1:
            self.total = after
        else:
            self._after[stage_index] = after

    def outgoing_forward(self, stage_index: int) -> torch.Tensor:
        return self._after.pop(stage_index)

    def incoming_forward(self, stage_index: int, vector: torch.Tensor) -> None:
        self._received[stage_index] = vector

    def outgoing_backward(self) -> torch.Tensor:
        assert self.total is not None, "a stage's last backward runs after the total reached it"
        return self.total

    def incoming_backward(self, vector: torch.Tensor) -> None:
        self.total = vector

    def result(self) -> list[float]:
        """The step's total on this rank (every one of its stages has run)."""
        assert self.total is not None, "every rank receives the total before its program ends"
        return self.total.tolist()
