"""The one interpreter loop: runs a rank's list of actions, whatever schedule made it.

    RF  receive activations from the previous stage      F   forward one micro-batch
    SF  send activations to the next stage (isend)       B   backward one micro-batch
    RB  receive gradients from the next stage            SB  send input gradients back (isend)
                                                         W   weight gradients of a split backward

In a program with W actions (zero-bubble schedules) B computes only the gradient of the stage's
input, which SB sends at once, and W the weight gradients later (see backward_split.py).
Message tags are unique per (micro-batch, sending stage, direction), but nothing relies on
them: a backend that ignores tags (NCCL) matches a rank pair's messages in posting order, so
the lowering orders every rank's receives as its peer sends (the validator checks it) and
receives are posted ahead strictly in program order.

In a pipeline of one rank per stage, the step's sums ride on the activations of each stage's last
forward and come back on the gradients of its last backward (`RidingSums`, riding_sums.py): an
extra leaf of those messages, under a key of its own.

Between stages of different tp widths a `Crossing` (crossing.py) moves the values tile by tile
in place of the one lane-to-lane message, and the receiving stage all-gathers them; between
stages of different dp widths a `RowCrossing` (row_crossing.py) moves them by row blocks.

A failure anywhere becomes a `PipelineError` naming this rank, the action, the peer, and the
rank x step grid with this rank's position marked.
"""

from __future__ import annotations

import bisect
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from plait.errors import ModelError, PipelineError, PlaitError, first_line, model_frame
from plait.runtime.comm.wire import Wire, WireTimeout
from plait.runtime.executor import StageExecutor, grad_leaves
from plait.runtime.failure import gather_failures, report_wait, stopped_by
from plait.runtime.riding_sums import RidingSums
from plait.runtime.tracer import NULL_TRACER, NullTracer, Tracer
from plait.runtime.widths.crossing import Crossing
from plait.runtime.widths.row_crossing import RowCrossing
from plait.schedule import Action, Op, Program, format_grid

__all__ = ["MicroBatch", "Interpreter", "forwards_done_after"]

_STREAM = {Op.FORWARD: "compute", Op.BACKWARD: "compute", Op.WEIGHT: "compute",
           Op.RECV_F: "recv", Op.RECV_B: "recv", Op.SEND_F: "send", Op.SEND_B: "send"}


@dataclass
class MicroBatch:
    """One micro-batch as every rank sees it: its model inputs, target and share of the batch."""

    inputs: list[Any]  # value of every graph placeholder
    target: Any
    scale: float  # rows in this micro-batch / rows in the global batch
    key: Hashable  # input shapes: equal keys mean equal activation shapes
    rows: int = 0  # rows of the whole micro-batch, over every replica of a stage (stage_dp cuts it by them)
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
        crossings: dict[int, Crossing | RowCrossing] | None = None,
    ):
        self.rank = rank
        self.crossings = crossings or {}  # boundary s (after stage s) -> its crossing, where widths differ
        self.tracer = tracer
        self.executors = executors
        self.stage_to_rank = list(stage_to_rank)
        self.num_chunks = len(stage_to_rank)
        self.wire = wire
        self.runs = 0  # programs run so far: names this run's failure reports in the store

    def run(
        self,
        program: Program,
        microbatches: Sequence[MicroBatch],
        train: bool,
        keep_outputs: bool = False,
        after_forwards: Callable[[], None] | None = None,
        forwards_done_at_weights: bool = False,
        sums: RidingSums | None = None,
        where: str = "",
    ) -> None:
        """Run this rank's part of `program` over `microbatches`: the one loop every schedule runs in.

        `after_forwards` is called once, right after this rank's last forward (before the first
        action if it has none): what the forwards decide (the losses, the non-finite flags) can
        start travelling while the backward passes run. With `forwards_done_at_weights`, it is
        called before the first W after that forward instead, where there is one: the input
        gradients computed and sent before it are what the previous stage waits for, the weight
        gradients are what nobody waits for, so the call's cost lands on the latter. `sums`: the
        step's sums riding on the messages (training, one rank per stage). `where` names the batch
        in errors ("epoch 2, batch 5 (training step 13)").
        """
        actions = program.get(self.rank, [])
        self.runs += 1
        run = _Run(microbatches, train, keep_outputs, split=any(a.op is Op.WEIGHT for a in actions), sums=sums)
        ahead = _ReceivesAhead(actions, window=self.num_chunks + 1)
        step = self.runs
        called_after = forwards_done_after(actions, forwards_done_at_weights)
        if after_forwards is not None and called_after < 0:
            after_forwards()

        def post(receive: Action) -> bool:
            with self.tracer.span("recv", f"post {receive}", step=step, stage=receive.stage_index,
                                  op="P" + receive.op.value, mb=receive.microbatch_index):
                return self._post(receive, run)

        for position, action in enumerate(actions):
            try:
                ahead.post_due(position, post)  # a peer gone while posting: reported as this action's failure
                with self.tracer.span(_STREAM[action.op], str(action), step=step, stage=action.stage_index,
                                      op=action.op.value, mb=action.microbatch_index):
                    self._execute(action, run)
                if position == called_after and after_forwards is not None:
                    after_forwards()
            except PlaitError as e:  # the user's mistake (a loss that is not a scalar...): as it is
                self._stop_peers(position, f"stopped with {type(e).__name__}: {first_line(e)} ({where})")
                raise
            except Exception as e:  # noqa: BLE001 - every failure gets the rank/action/peer report
                if action.op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT) and not _transport(e):
                    raise self._raised(position, action, e, where) from e
                failure = self._failure(program, position, action, e, where)
                raise failure from (None if isinstance(failure, ModelError) else e)  # stopped: the wait is no news
        self._finish(program, len(actions), train)

    def _execute(self, action: Action, run: "_Run") -> None:
        """One action: a receive, a compute (F, B, W) or a send, on the run's buffers."""
        s, k, op = action.stage_index, action.microbatch_index, action.op
        mb = run.microbatches[k]
        sums = run.sums
        if op is Op.RECV_F:
            key, tag, crossing = _key(s - 1, k, run), self._tag(k, s - 1, 0), self.crossings.get(s - 1)
            if crossing is not None:
                run.inbox[(s, k)] = crossing.recv_forward(self.wire, key, tag)
            else:
                run.inbox[(s, k)], _ = self.wire.recv(self.stage_to_rank[s - 1], key, tag)
                if sums is not None and sums.rides_forward(s - 1, k):
                    sums.incoming_forward(s, run.inbox[(s, k)].pop())
        elif op is Op.FORWARD:
            received = run.inbox.pop((s, k), None)
            if received is None:  # producer on this rank: handed over locally
                received = run.outbox.pop((s - 1, k), []) if s > 0 else []
            ex = self.executors[s]
            inputs = [mb.inputs[i] for i in ex.stage.input_indices]
            out = ex.forward(k, received, inputs, mb.target, mb.scale, run.train, run.keep_outputs)
            if not ex.stage.is_last:
                run.outbox[(s, k)] = out
            if sums is not None:
                sums.forward_done(s, k)
        elif op is Op.SEND_F:
            values = run.outbox.pop((s, k))
            key, tag, crossing = _key(s, k, run), self._tag(k, s, 0), self.crossings.get(s)
            if crossing is not None:
                crossing.send_forward(values, self.wire, key, tag, mb.rows)
            else:
                riding = [sums.outgoing_forward(s)] if sums is not None and sums.rides_forward(s, k) else []
                self.wire.send(values + riding, self.stage_to_rank[s + 1], key, tag)
            if run.train:
                run.sent_like[(s, k)] = grad_leaves(values)
        elif op is Op.RECV_B:
            like, crossing = run.sent_like.pop((s, k)), self.crossings.get(s)
            if crossing is not None:
                run.grads_in[(s, k)] = crossing.recv_backward(like, self.wire, self._tag(k, s + 1, 1),
                                                              _key(s, k, run))
            else:
                carrier = sums if sums is not None and sums.rides_backward(s + 1, k) else None
                got = self.wire.recv_tensors(like + ([carrier.like()] if carrier else []),
                                             self.stage_to_rank[s + 1], self._tag(k, s + 1, 1))
                if carrier is not None:
                    carrier.incoming_backward(got.pop())
                run.grads_in[(s, k)] = got
        elif op is Op.BACKWARD:
            grads = run.grads_in.pop((s, k), None)
            if grads is None:
                grads = run.grads_out.pop((s + 1, k), [])
            ex = self.executors[s]
            run.grads_out[(s, k)] = ex.backward_input(k, grads) if run.split else ex.backward(k, grads)
        elif op is Op.WEIGHT:
            self.executors[s].backward_weight(k)
        elif op is Op.SEND_B:
            crossing = self.crossings.get(s - 1)
            if crossing is not None:
                crossing.send_backward(run.grads_out.pop((s, k)), self.wire, self._tag(k, s, 1),
                                       _key(s - 1, k, run))
            else:
                riding = [sums.outgoing_backward()] if sums is not None and sums.rides_backward(s, k) else []
                self.wire.send_tensors(run.grads_out.pop((s, k)) + riding, self.stage_to_rank[s - 1], self._tag(k, s, 1))
        else:  # pragma: no cover - the validator rejects unknown actions
            raise AssertionError(f"unknown action {action}")

    def _finish(self, program: Program, num_actions: int, train: bool) -> None:
        """After the last action: batched weight gradients and zero=3's reduce-scatters after a split
        backward (training), then every send delivered."""
        step = self.runs
        if train:
            try:
                for s, ex in self.executors.items():
                    if ex.finishes:
                        with self.tracer.span("compute", "batched weight gradients" if ex.weight_batch is not None
                                              else "gradients reduce-scattered", step=step, stage=s):
                            ex.finish_step()
            except PlaitError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self._failure(program, num_actions, None, e) from e
        try:
            with self.tracer.span("wait", "sends done", step=step):
                self.wire.drain()
        except Exception as e:  # noqa: BLE001
            raise self._failure(program, num_actions, None, e) from e

    def _post(self, action: Action, run: "_Run") -> bool:
        """Post one receive ahead, if its message's shapes are known (from the second step on);
        False if they are not."""
        s, k = action.stage_index, action.microbatch_index
        if action.op is Op.RECV_F:
            crossing = self.crossings.get(s - 1)
            if crossing is not None:
                return crossing.post_forward(self.wire, _key(s - 1, k, run), self._tag(k, s - 1, 0))
            return self.wire.post_recv(self.stage_to_rank[s - 1], _key(s - 1, k, run), self._tag(k, s - 1, 0))
        if s in self.crossings:
            return self.crossings[s].post_backward(self.wire, _key(s, k, run), self._tag(k, s + 1, 1))
        extra = [run.sums.spec] if run.sums is not None and run.sums.rides_backward(s + 1, k) else []
        return self.wire.post_recv_grads(self.stage_to_rank[s + 1], _key(s, k, run), self._tag(k, s + 1, 1), extra)

    def _tag(self, microbatch_index: int, sender: int, backward: int) -> int:
        """Message tag of micro-batch k sent by stage `sender`, forward (0) or backward (1)."""
        return 2 * (microbatch_index * self.num_chunks + sender) + backward

    def _peer(self, action: Action) -> int | None:
        s = action.stage_index
        boundary = s - 1 if action.op in (Op.RECV_F, Op.SEND_B) else s
        if action.op in (Op.RECV_F, Op.SEND_B, Op.SEND_F, Op.RECV_B) and boundary in self.crossings:
            return self.crossings[boundary].peers[0]  # the first of the other stage's ranks it exchanges with
        if action.op in (Op.RECV_F,):
            return self.stage_to_rank[s - 1]
        if action.op in (Op.SEND_F, Op.RECV_B):
            return self.stage_to_rank[s + 1]
        if action.op is Op.SEND_B:
            return self.stage_to_rank[s - 1]
        return None

    def _stop_peers(self, position: int, cause: str) -> None:
        """Post `cause` and close this rank's connections: every peer stops at once (report.py).
        The wait is short: the peers post within moments, and rank 0 may host the store."""
        self.wire.abandon()
        gather_failures(self.runs, self.rank, position, 2.0, cause)

    def _raised(self, position: int, action: Action, error: Exception, where: str) -> ModelError:
        """The error of a rank whose model code (forward, loss, backward) raised: the user's
        exception and line first, then where in training; the peers are stopped first."""
        kind = {Op.FORWARD: "forward (and loss)", Op.BACKWARD: "backward", Op.WEIGHT: "weight gradients"}[action.op]
        frame, text = model_frame(error), f"{type(error).__name__}: {first_line(error)}"
        at = f"stage {action.stage_index}'s {kind} of micro-batch {action.microbatch_index}, {where or 'a step'}"
        self._stop_peers(position, f"raised {text} in {at}" + (f", at {frame}" if frame else ""))
        return ModelError(f"rank {self.rank}: the model's code raised {text}\n  "
                          + (f"at {frame}\n  " if frame else "")
                          + f"in {at} (action {action}); every other rank was stopped")

    def _failure(
        self, program: Program, position: int, action: Action | None, error: Exception, where: str = ""
    ) -> PipelineError | ModelError:
        what = f"action {action} (column {position} of the grid below)" if action else "waiting for its sends to finish"
        peer = self._peer(action) if action else None
        peer_text = f", peer rank {peer}" if peer is not None else ""
        self.wire.abandon()
        # Peers stuck behind the same fault fail within about one timeout of the first failure.
        failures = gather_failures(self.runs, self.rank, position, report_wait(self.wire.timeout.total_seconds()))
        stopped = stopped_by(self.rank, failures, f"at {action or 'the end of its program'}, {where or 'a step'}")
        if stopped is not None:
            return stopped
        grid = format_grid(program, failures.positions)
        return PipelineError(
            f"rank {self.rank} failed at {what}{peer_text}" + (f" in {where}" if where else "")
            + f": {type(error).__name__}: {error}\n"
            f"{failures.describe()}\n"
            f"where each rank stood in the schedule (marked):\n{grid}"
        )


def _transport(error: BaseException) -> bool:
    """Whether `error` came from moving data between ranks (a wire or collective wait), not from
    the model's code: tensor-parallel collectives run inside a stage's forward and backward."""
    if isinstance(error, (WireTimeout, dist.DistError)):
        return True
    frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(error.__traceback__)]
    return any("/torch/distributed/" in f for f in frames) or "gloo" in str(error) or "NCCL" in str(error)


def forwards_done_after(actions: Sequence[Action], at_weights: bool = False) -> int:
    """The position of the action after which a rank's forwards are done (-1: before the first):
    its last forward, or with `at_weights` the action before the first W after it, where there is
    one (see `Interpreter.run`)."""
    last = max((i for i, a in enumerate(actions) if a.op is Op.FORWARD), default=-1)
    if at_weights and last >= 0:
        return next((i - 1 for i in range(last + 1, len(actions)) if actions[i].op is Op.WEIGHT), last)
    return last


@dataclass
class _Run:
    """One run of a program: its micro-batches and the buffers between its actions."""

    microbatches: Sequence[MicroBatch]
    train: bool
    keep_outputs: bool
    split: bool  # the program has W actions: B computes input gradients only
    inbox: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # (stage, mb) -> received activations
    outbox: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # (stage, mb) -> activations to send
    grads_in: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    sent_like: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # what SF sent, for RB shapes
    sums: RidingSums | None = None


def _key(sender: int, microbatch_index: int, run: _Run) -> Hashable:
    """The wire key of the activations stage `sender` sends for a micro-batch: its input shapes,
    and whether the step's sums ride on them (a message of another description)."""
    key = ("F", sender, run.train, run.microbatches[microbatch_index].key)
    if run.sums is not None and run.sums.rides_forward(sender, microbatch_index):
        return key + ("sums",)
    return key


class _ReceivesAhead:
    """Receives posted ahead (see wire.py), strictly in program order: at most `window` at a time,
    so a 1F1B stage holds no more incoming buffers than it holds micro-batches in flight.

    A receive whose message's shapes are not known yet (the first step) cannot be posted ahead;
    it is taken when its action comes, and no later receive is posted before then. NCCL ignores
    tags and matches a rank pair's messages in the order the receives are posted, so a later
    receive posted first would take this one's message (the validator checks that programs
    receive in send order; this keeps the posting in that order).
    """

    def __init__(self, actions: Sequence[Action], window: int) -> None:
        self.actions = actions
        self.receives = [i for i, a in enumerate(actions) if a.op in (Op.RECV_F, Op.RECV_B)]
        self.window = window
        self.offered = 0  # receives offered for posting so far, in program order
        self.held: int | None = None  # the receive that could not be posted, until it is taken
        # Posting starts at this rank's first receive, or right after its first send if that comes
        # sooner: a rank that opens with compute (the first stage's forwards) sends its first
        # activation before it spends time posting receives it needs only later.
        sends = [i + 1 for i, a in enumerate(actions) if a.op in (Op.SEND_F, Op.SEND_B)]
        self.start = min(self.receives[:1] + sends[:1], default=len(actions))

    def post_due(self, position: int, post: Callable[[Action], bool]) -> None:
        """Offer `post` the receives due before the action at `position`, in program order; after
        one it cannot post (it returns False), offer none until that receive has been taken."""
        if position < self.start:
            return
        done = bisect.bisect_left(self.receives, position)  # receives already taken
        if self.held is not None and self.held < done:
            self.held = None
        while self.held is None and self.offered < len(self.receives) and self.offered - done < self.window:
            if not post(self.actions[self.receives[self.offered]]):
                self.held = self.offered
            self.offered += 1
