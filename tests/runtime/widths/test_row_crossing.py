"""Crossings between stages of different dp widths: each receiving replica gets exactly its rows of
every batch-major value (and the others whole), and each sending replica the gradients of its rows
(and of the others, their sum over its receivers, counted once)."""

import pytest
import torch

from tests.harness import run_ranks

STAGE_A, STAGE_B = [0, 1], [2, 3, 4]  # 2 replicas, then 3: replica 1 of B takes rows from both of A
ROWS = 6  # of the micro-batch


def whole(step: int) -> list:
    """The stage output of the whole micro-batch (one process): a transposed batch-major tensor
    requiring grad, a value with no rows requiring grad, an integer batch-major one, numbers, None."""
    big = (torch.arange(ROWS * 5.0).view(5, ROWS) + step).t()  # (6, 5), not contiguous
    return [big, {"bias": torch.tensor([[1.5, -2.0]]), "ids": torch.arange(ROWS) * step}, 3, None]


def block(step: int, lo: int, hi: int, grad: bool = True) -> list:
    big, parts, n, none = whole(step)
    return [big[lo:hi].clone().requires_grad_(grad),  # the clone keeps the transposed dimension order
            {"bias": parts["bias"].clone().requires_grad_(grad), "ids": parts["ids"][lo:hi]}, n, none]


def upstream(step: int) -> list[torch.Tensor]:
    """The gradients of the whole micro-batch's values that require grad: (6, 5) and (1, 2)."""
    return [torch.arange(ROWS * 5.0).view(ROWS, 5) * (step + 1), torch.tensor([[10.0, 20.0]]) * (step + 1)]


def cross(rank: int, world: int) -> list:
    import torch.distributed as dist

    from plait.cost.row_blocks import row_block
    from plait.runtime.comm.wire import Wire
    from plait.runtime.executor import grad_leaves
    from plait.runtime.widths.row_crossing import RowCrossing

    dist.init_process_group("gloo")
    wire = Wire(timeout_s=20)
    out = []
    for senders, receivers in ((STAGE_A, STAGE_B), (STAGE_B, STAGE_A)):  # 2 -> 3, 3 -> 2
        crossing = RowCrossing(0, senders, receivers, rank, [True, None, None, None])
        side = senders if crossing.sending else receivers
        lo, hi = row_block(ROWS, len(side), side.index(rank))
        for step in range(2):  # the second time the descriptions are known: receives are posted ahead
            key, tag = ("F", 0, True, "shapes"), 2 * step
            if crossing.sending:
                sent = block(step, lo, hi)
                crossing.send_forward(sent, wire, key, tag, ROWS)
                if step:
                    assert crossing.post_backward(wire, key, tag + 1)
                out.append(("gradients", crossing.recv_backward(grad_leaves(sent), wire, tag + 1, key), lo, hi))
            else:
                if step:
                    assert crossing.post_forward(wire, key, tag)
                got = crossing.recv_forward(wire, key, tag)
                out.append(("values", got, lo, hi))
                big, bias = upstream(step)
                share = (hi - lo) / ROWS  # each replica's part of the bias's gradient: its rows'
                crossing.send_backward([big[lo:hi], bias * share], wire, tag + 1, key)
            wire.drain()
    return out


@pytest.mark.timeout(120)
def test_rows_cross_between_two_and_three_replicas_and_back() -> None:
    report = run_ranks(5, cross, timeout=110)
    for rank, results in enumerate(report):
        assert len(results) == 4, rank
        for i, (kind, got, lo, hi) in enumerate(results):
            step = i % 2
            if kind == "gradients":
                assert torch.equal(got[0], upstream(step)[0][lo:hi]), (rank, step)
                assert got[1].shape == (1, 2), rank
                continue
            want = block(step, lo, hi)
            assert torch.equal(got[0], want[0]) and got[0].requires_grad, (rank, step)
            assert got[0].stride() == want[0].stride(), (rank, got[0].stride())  # the sender's layout
            assert torch.equal(got[1]["bias"], want[1]["bias"]) and got[1]["bias"].requires_grad
            assert torch.equal(got[1]["ids"], want[1]["ids"]) and got[1]["ids"].dtype == torch.int64
            assert got[2:] == [3, None]
    # The value of no rows: each receiver's share of its gradient reaches one sender, so over the
    # senders it adds up to the whole gradient once (2 -> 3 first, then 3 -> 2; two steps each).
    for direction, senders in enumerate((STAGE_A, STAGE_B)):
        for step in range(2):
            total = sum(report[r][2 * direction + step][1][1] for r in senders)
            assert torch.allclose(total, upstream(step)[1]), (senders, step, total)
