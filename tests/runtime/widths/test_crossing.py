"""Crossings between stages of different widths: the values arrive whole on every rank of the
receiving stage, and the gradients whole on every rank of the sending one."""

import pytest
import torch

from tests.harness import run_ranks

STAGE_A, STAGE_B = [0, 1, 2], [3, 4]  # 3 ranks, then 2: uneven shares in both all-gathers


def values(step: int) -> list:
    """A stage output of every kind: a transposed tensor requiring grad, a small one (crosses
    whole), an integer one, numbers, None and a size."""
    big = (torch.arange(35.0).view(5, 7) + step).t().requires_grad_()  # (7, 5), not contiguous
    return [big, {"small": torch.tensor([1.5, -2.0], requires_grad=True), "ids": torch.arange(8) * step},
            3, 0.5, None, torch.Size([2, 4])]


def gradients(step: int) -> list[torch.Tensor]:
    return [torch.arange(35.0).view(7, 5) * (step + 1), torch.tensor([10.0, 20.0]) * step]


def cross(rank: int, world: int) -> list:
    import torch.distributed as dist

    from plait.runtime.comm.collectives import make_group
    from plait.runtime.comm.wire import Wire
    from plait.runtime.executor import grad_leaves
    from plait.runtime.widths.crossing import Crossing

    dist.init_process_group("gloo")
    groups = [make_group(STAGE_A), make_group(STAGE_B)]
    group = groups[0] if rank in STAGE_A else groups[1]
    wire = Wire(timeout_s=20)
    out = []
    boundaries = [(STAGE_A, STAGE_B), (STAGE_B, STAGE_A)]  # narrowing 3 -> 2, widening 2 -> 3
    for b, ((senders, receivers), whole) in enumerate((sides, whole) for whole in (False, True) for sides in boundaries):
        crossing = Crossing(0, senders, receivers, rank, group, whole=whole)
        for step in range(2):  # the second time the descriptions are known: receives are posted ahead
            key, tag = ("F", b, True, "shapes"), 2 * step + 4 * b
            if crossing.sending:
                sent = values(step)
                crossing.send_forward(sent, wire, key, tag)
                if step:
                    assert crossing.post_backward(wire, key, tag + 1)
                out.append(("gradients", crossing.recv_backward(grad_leaves(sent), wire, tag + 1)))
            else:
                if step:
                    assert crossing.post_forward(wire, key, tag)
                got = crossing.recv_forward(wire, key, tag)
                out.append(("values", got))
                crossing.send_backward(gradients(step), wire, tag + 1)
            wire.drain()
    return out


@pytest.mark.timeout(120)
def test_values_and_gradients_cross_whole_between_three_and_two_ranks() -> None:
    """Both ways, as tiles with a local all-gather and as whole values (Crossing(whole=True))."""
    for rank, results in enumerate(run_ranks(5, cross, timeout=110)):
        assert len(results) == 8, rank
        for first in (0, 2, 4, 6):
            for step, (kind, got) in enumerate(results[i] for i in (first, first + 1)):
                _check(kind, got, step, rank)


def _check(kind: str, got: list, step: int, rank: int) -> None:
    if kind == "gradients":
        want = gradients(step)
        assert [tuple(g.shape) for g in got] == [(7, 5), (2,)], rank
        for g, w in zip(got, want):
            assert torch.equal(g, w), (rank, step)
        return
    big, parts, i, f, none, size = got
    want = values(step)
    assert torch.equal(big, want[0]) and big.requires_grad and big.stride() == want[0].stride(), (rank, step)
    assert torch.equal(parts["small"], want[1]["small"]) and parts["small"].requires_grad
    assert torch.equal(parts["ids"], want[1]["ids"]) and parts["ids"].dtype == torch.int64
    assert (i, f, none, tuple(size)) == (3, 0.5, None, (2, 4))
