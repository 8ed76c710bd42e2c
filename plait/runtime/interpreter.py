"""The one interpreter loop: runs a rank's list of actions, whatever schedule made it.

    RF  receive activations from the previous stage      F   forward one micro-batch
    SF  send activations to the next stage (isend)       B   backward one micro-batch
    RB  receive gradients from the next stage            SB  send input gradients back (isend)
                                                         W   weight gradients of a split backward

In a program with W actions (zero-bubble schedules) B computes only the gradient of the stage's
input, which SB sends at once, and W the weight gradients later (see backward_split.py).
Message tags are unique per (micro-batch, sending stage, direction), so several stages of one
rank (interleaved schedules) never mix up their messages with the same peer.

A failure anywhere becomes a `PipelineError` naming this rank, the action, the peer, and the
rank x step grid with this rank's position marked.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from plait.errors import PipelineError, PlaitError
from plait.runtime.executor import StageExecutor, grad_leaves
from plait.runtime.report import gather_failures, report_wait
from plait.runtime.trace import NULL_TRACER, NullTracer, Tracer
from plait.runtime.wire import Wire
from plait.schedule import Action, Op, Program, format_grid

__all__ = ["MicroBatch", "Interpreter"]

_STREAM = {Op.FORWARD: "compute", Op.BACKWARD: "compute", Op.WEIGHT: "compute",
           Op.RECV_F: "recv", Op.RECV_B: "recv", Op.SEND_F: "send", Op.SEND_B: "send"}


@dataclass
class MicroBatch:
    """One micro-batch as every rank sees it: its model inputs, target and share of the batch."""

    inputs: list[Any]  # value of every graph placeholder
    target: Any
    scale: float  # rows in this micro-batch / rows in the global batch
    key: Hashable  # input shapes: equal keys mean equal activation shapes
    extra: dict[str, Any] = field(default_factory=dict)


class Interpreter:
    """Executes per-rank programs for the stages this rank holds."""

    def __init__(
        self,
        rank: int,
        executors: dict[int, StageExecutor],
        stage_to_rank: Sequence[int],
        wire: Wire,
        tracer: Tracer | NullTracer = NULL_TRACER,
    ):
        self.rank = rank
        self.tracer = tracer
        self.executors = executors
        self.stage_to_rank = list(stage_to_rank)
        self.num_stages = len(stage_to_rank)
        self.wire = wire
        self.runs = 0  # programs run so far: names this run's failure reports in the store

    def run(
        self,
        program: Program,
        microbatches: Sequence[MicroBatch],
        train: bool,
        keep_outputs: bool = False,
    ) -> None:
        """Run this rank's part of `program` over `microbatches`."""
        actions = program.get(self.rank, [])
        self.runs += 1
        inbox: dict[tuple[int, int], list[Any]] = {}  # (stage, mb) -> received activations
        outbox: dict[tuple[int, int], list[Any]] = {}  # (stage, mb) -> activations to send
        grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        sent_like: dict[tuple[int, int], list[torch.Tensor]] = {}  # what SF sent, for RB shapes
        # Receives posted ahead (see wire.py): at most `window` at a time, so a 1F1B stage holds
        # no more incoming buffers than it holds micro-batches in flight.
        receives = [i for i, a in enumerate(actions) if a.op in (Op.RECV_F, Op.RECV_B)]
        window, posted = self.num_stages + 1, 0
        split = any(a.op is Op.WEIGHT for a in actions)
        tracer, step = self.tracer, self.runs
        for position, action in enumerate(actions):
            s, k, op = action.stage_index, action.microbatch_index, action.op
            mb = microbatches[k]
            done = bisect.bisect_left(receives, position)  # receives already taken
            while posted < len(receives) and posted - done < window:
                ahead = actions[receives[posted]]
                with tracer.span("recv", f"post {ahead}", step=step, stage=ahead.stage_index,
                                 op="P" + ahead.op.value, mb=ahead.microbatch_index):
                    self._post(ahead, microbatches, train)
                posted += 1
            try:
                with tracer.span(_STREAM[op], str(action), step=step, stage=s, op=op.value, mb=k):
                    if op is Op.RECV_F:
                        peer = self.stage_to_rank[s - 1]
                        inbox[(s, k)], _ = self.wire.recv(peer, ("F", s - 1, train, mb.key), self._tag(k, s - 1, 0))
                    elif op is Op.FORWARD:
                        received = inbox.pop((s, k), None)
                        if received is None:  # producer on this rank: handed over locally
                            received = outbox.pop((s - 1, k), []) if s > 0 else []
                        ex = self.executors[s]
                        inputs = [mb.inputs[i] for i in ex.stage.input_indices]
                        out = ex.forward(k, received, inputs, mb.target, mb.scale, train, keep_outputs)
                        if not ex.stage.is_last:
                            outbox[(s, k)] = out
                    elif op is Op.SEND_F:
                        values = outbox.pop((s, k))
                        self.wire.send(values, self.stage_to_rank[s + 1], ("F", s, train, mb.key), self._tag(k, s, 0))
                        if train:
                            sent_like[(s, k)] = grad_leaves(values)
                    elif op is Op.RECV_B:
                        like = sent_like.pop((s, k))
                        grads_in[(s, k)] = self.wire.recv_tensors(like, self.stage_to_rank[s + 1], self._tag(k, s + 1, 1))
                    elif op is Op.BACKWARD:
                        grads = grads_in.pop((s, k), None)
                        if grads is None:
                            grads = grads_out.pop((s + 1, k), [])
                        ex = self.executors[s]
                        grads_out[(s, k)] = ex.backward_input(k, grads) if split else ex.backward(k, grads)
                    elif op is Op.WEIGHT:
                        self.executors[s].backward_weight(k)
                    elif op is Op.SEND_B:
                        self.wire.send_tensors(grads_out.pop((s, k)), self.stage_to_rank[s - 1], self._tag(k, s, 1))
                    else:  # pragma: no cover - the validator rejects unknown actions
                        raise AssertionError(f"unknown action {action}")
            except PlaitError:  # the user's mistake (a loss that is not a scalar...): as it is
                raise
            except Exception as e:  # noqa: BLE001 - every failure gets the rank/action/peer report
                raise self._failure(program, position, action, e) from e
        if train:
            try:
                for s, ex in self.executors.items():
                    if ex.weight_batch is not None:
                        with tracer.span("compute", "batched weight gradients", step=step, stage=s):
                            ex.finish_step()
            except PlaitError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self._failure(program, len(actions), None, e) from e
        try:
            with tracer.span("wait", "sends done", step=step):
                self.wire.drain()
        except Exception as e:  # noqa: BLE001
            raise self._failure(program, len(actions), None, e) from e

    def _post(self, action: Action, microbatches: Sequence[MicroBatch], train: bool) -> None:
        """Post one receive ahead, if its message's shapes are known (from the second step on)."""
        s, k = action.stage_index, action.microbatch_index
        key = microbatches[k].key
        if action.op is Op.RECV_F:
            self.wire.post_recv(self.stage_to_rank[s - 1], ("F", s - 1, train, key), self._tag(k, s - 1, 0))
        else:
            self.wire.post_recv_grads(self.stage_to_rank[s + 1], ("F", s, train, key), self._tag(k, s + 1, 1))

    def _tag(self, microbatch_index: int, sender: int, backward: int) -> int:
        """Message tag of micro-batch k sent by stage `sender`, forward (0) or backward (1)."""
        return 2 * (microbatch_index * self.num_stages + sender) + backward

    def _peer(self, action: Action) -> int | None:
        s = action.stage_index
        if action.op in (Op.RECV_F,):
            return self.stage_to_rank[s - 1]
        if action.op in (Op.SEND_F, Op.RECV_B):
            return self.stage_to_rank[s + 1]
        if action.op is Op.SEND_B:
            return self.stage_to_rank[s - 1]
        return None

    def _failure(
        self, program: Program, position: int, action: Action | None, error: Exception
    ) -> PipelineError:
        what = f"action {action} (step {position})" if action else "waiting for its sends to finish"
        peer = self._peer(action) if action else None
        peer_text = f", peer rank {peer}" if peer is not None else ""
        self.wire.abandon()
        # Peers stuck behind the same fault fail within about one timeout of the first failure.
        failures = gather_failures(self.runs, self.rank, position, report_wait(self.wire.timeout.total_seconds()))
        grid = format_grid(program, failures.positions)
        return PipelineError(
            f"rank {self.rank} failed at {what}{peer_text}: {type(error).__name__}: {error}\n"
            f"{failures.describe()}\n"
            f"where each rank stood in the schedule (marked):\n{grid}"
        )
