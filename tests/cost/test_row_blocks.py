"""The row map of resharding along the batch: exact blocks, pairs and overlaps, no processes."""

import pytest

from plait.cost.row_blocks import RowMap, check_rows, row_block
from plait.errors import ConfigError


def test_each_replica_runs_an_equal_block_in_replica_order() -> None:
    assert [row_block(6, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
    assert row_block(4, 1, 0) == (0, 4)


def test_joining_two_replicas_into_one_sends_each_its_half() -> None:
    m = RowMap(2, 1)
    assert m.receivers_of(0) == (0,) and m.receivers_of(1) == (0,) and m.senders_of(0) == (0, 1)
    assert [m.overlap(0, 0, 4), m.overlap(1, 0, 4)] == [(0, 2), (2, 4)]


def test_splitting_one_into_two_replicas_sends_each_its_half() -> None:
    m = RowMap(1, 2)
    assert m.receivers_of(0) == (0, 1) and m.senders_of(0) == (0,) and m.senders_of(1) == (0,)
    assert [m.overlap(0, 0, 4), m.overlap(0, 1, 4)] == [(0, 2), (2, 4)]
    assert m.reversed() == RowMap(2, 1)


def test_two_into_three_replicas_share_the_middle_rows() -> None:
    m = RowMap(2, 3)
    assert [m.receivers_of(0), m.receivers_of(1)] == [(0, 1), (1, 2)]
    assert [m.senders_of(j) for j in range(3)] == [(0,), (0, 1), (1,)]
    assert [m.overlap(0, 1, 6), m.overlap(1, 1, 6)] == [(2, 3), (3, 4)]
    assert m.overlap(0, 2, 6) == (4, 4) and not m.exchange(0, 2)  # no shared rows: no message


@pytest.mark.parametrize("senders, receivers", [(2, 1), (1, 2), (3, 2), (2, 3), (4, 2), (3, 4), (1, 3)])
@pytest.mark.parametrize("scale", [1, 2, 5])
def test_every_row_crosses_once_and_the_pairs_do_not_depend_on_the_size(senders: int, receivers: int,
                                                                       scale: int) -> None:
    m = RowMap(senders, receivers)
    rows = senders * receivers * scale
    for j in range(receivers):
        got = [m.overlap(i, j, rows) for i in m.senders_of(j)]
        assert got[0][0] == row_block(rows, receivers, j)[0] and got[-1][1] == row_block(rows, receivers, j)[1]
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(got, got[1:] + [(got[-1][1], 0)]))
        assert all(m.overlap(i, j, rows)[0] == m.overlap(i, j, rows)[1]
                   for i in range(senders) if i not in m.senders_of(j))
    assert all(j in m.receivers_of(i) for j in range(receivers) for i in m.senders_of(j))


def test_rows_that_do_not_divide_are_refused_with_the_fix() -> None:
    check_rows(4, (2, 1))
    with pytest.raises(ConfigError, match=r"micro-batch of 3 rows does not divide by dp=\[2\] of "
                                          r"stage_dp=\[2, 1\].*num_microbatches x a multiple of 2"):
        check_rows(3, (2, 1))
    with pytest.raises(ConfigError, match=r"dp=\[2, 3\].*a multiple of 6"):
        RowMap(2, 3).overlap(0, 0, 5)
    with pytest.raises(ConfigError, match="RowMap has senders=0"):
        RowMap(0, 1)
    with pytest.raises(ConfigError, match="has no sender 2"):
        RowMap(2, 1).receivers_of(2)


def test_a_row_crossing_costs_the_busiest_rank_s_messages_and_rows() -> None:
    from plait.cost.network import Link
    from plait.cost.row_blocks import row_crossing_time

    link = Link(1e-3, 1e9)
    assert row_crossing_time(8e6, 2, 2, link) == pytest.approx(1e-3 + 4e6 / 1e9)  # each replica its half
    assert row_crossing_time(8e6, 2, 1, link) == pytest.approx(2e-3 + 8e6 / 1e9)  # the one receiver: both halves
    assert row_crossing_time(8e6, 1, 4, link) == pytest.approx(4e-3 + 8e6 / 1e9)  # the one sender: four quarters
    assert row_crossing_time(8e6, 4, 2, link) == pytest.approx(2e-3 + 4e6 / 1e9)
    assert row_crossing_time(0.0, 2, 1, link) == 0.0
