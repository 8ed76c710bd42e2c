"""`StepSums`: a step's loss and metric sums and non-finite flags, summed over the job (all-reduced or riding)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from plait import data as batching
from plait.metrics import METRICS
from plait.runtime.comm.collectives import start_sum_floats
from plait.runtime.interpreter import MicroBatch
from plait.runtime.riding_sums import RidingSums, carriers

__all__ = ["StepSums", "num_stats"]


def num_stats(metrics: Sequence[str]) -> int:
    """Length of a step's sums: the loss x rows, then (correct, counted) per metric."""
    return 1 + 2 * len(metrics)


class StepSums:
    """A step's loss and metric sums and non-finite flags, summed over the job.

    `start` runs once this rank's forwards are done (the interpreter calls it after its last
    forward): everything it sums is known then, so the all-reduce travels while the backward passes
    run instead of after them. Every rank issues it before any gradient bucket of the step (the
    buckets complete only in the last micro-batch's backward, or at `flush`), so where both share
    the default group, every rank issues them in the same order. In a pipeline (pp > 1) nothing
    else of the step is on the default group (the buckets and tp's collectives are on groups of
    one stage), so `start` waits for the rank's first W after its last forward, where there is
    one: issuing a collective costs the issuing rank's core ~0.25 ms of gloo's thread, which then
    lands on weight gradients nobody waits for rather than between the last stage's last forward
    and the input gradient its previous stage waits for.
    """

    def __init__(self, runner: Any, mbs: list[MicroBatch], keep_outputs: bool) -> None:
        # runner: the step's `plait.runtime.step.StepRunner` (which imports this module)
        self.runner, self.mbs, self.keep_outputs = runner, mbs, keep_outputs
        self.stats: list[float] = []
        self.outputs: list[Any] | None = None
        self.total: Callable[[], list[float]] = list
        self.length = 0  # of the riding vector: the stats, then the flags (`riding`)

    def start(self) -> None:
        runner = self.runner
        pipe = runner.pipe
        self.stats, self.outputs = self._local_stats()
        flags = [] if runner.watch is None else runner.watch.finish(
            pipe.last_executor.losses if pipe.is_last else {})
        self.total = start_sum_floats(self.stats + flags)

    def riding(self, program: Any) -> RidingSums:
        """The sums of this step riding on the messages of `program` (in place of `start`)."""
        runner = self.runner
        carried = runner.carried.get(len(self.mbs))
        if carried is None:
            carried = runner.carried[len(self.mbs)] = carriers(program)
        num_chunks = runner.pipe.plan.num_chunks
        self.stats = [0.0] * num_stats(runner.metrics)  # a stage before the last adds none
        self.length = len(self.stats) + (0 if runner.watch is None else num_chunks + 1)
        sums = RidingSums(carried, num_chunks, self.length, self.own, runner.device)
        self.total = sums.result
        return sums

    def own(self, stage_index: int) -> list[float]:
        """What stage `stage_index` of this rank adds to the step's sums, once its forwards are
        done: its non-finite flag; the last stage also the loss and metric sums and the loss's flag."""
        runner = self.runner
        pipe, watch, n = runner.pipe, runner.watch, len(self.stats)
        vector = [0.0] * self.length
        if watch is not None:
            vector[n + stage_index] = watch.stage_flag(stage_index)
        if stage_index == pipe.plan.num_chunks - 1:
            self.stats, self.outputs = self._local_stats()
            vector[:n] = self.stats
            if watch is not None:
                vector[-1] = watch.loss_flag(pipe.last_executor.losses)
        return vector

    def _local_stats(self) -> tuple[list[float], list[Any] | None]:
        """This rank's [sum of loss x rows, (correct, counted) per metric] and kept outputs."""
        pipe, metrics, mbs = self.runner.pipe, self.runner.metrics, self.mbs
        stats = [0.0] * num_stats(metrics)
        outputs = None
        if pipe.is_last:
            ex = pipe.last_executor
            counted = pipe.tp_rank == 0  # the tp ranks of the last stage hold the same loss: one counts it
            for k, mb in enumerate(mbs):
                if mb.target is None or not counted:
                    continue
                stats[0] += ex.losses.get(k, 0.0) * batching.num_rows(mb.target)
                for i, name in enumerate(metrics):
                    c, n = METRICS[name](ex.outputs[k], mb.target)
                    stats[1 + 2 * i] += c
                    stats[2 + 2 * i] += n
            if self.keep_outputs:
                outputs = [ex.outputs[k] for k in range(len(mbs))]
            ex.outputs.clear()
        return stats, outputs
