"""The tile map of cross-mesh resharding: exact pairs, tiles and bounds, no processes."""

import pytest

from plait.cost.tiles import TileMap
from plait.errors import ConfigError


def test_narrowing_two_to_one_sends_one_tile_from_each_sender() -> None:
    m = TileMap(2, 1)
    assert m.num_tiles == 2 and not m.gathers
    assert [m.tile(0, 0), m.tile(1, 0)] == [0, 1]
    assert m.receivers_of(0) == (0,) and m.receivers_of(1) == (0,)
    assert m.senders_of(0) == (0, 1) and m.held(0) == (0, 1)


def test_widening_one_to_two_sends_a_tile_to_each_receiver_which_all_gather() -> None:
    m = TileMap(1, 2)
    assert m.num_tiles == 2 and m.gathers
    assert m.receivers_of(0) == (0, 1)
    assert m.senders_of(0) == (0,) and m.senders_of(1) == (0,)
    assert [m.held(0), m.held(1)] == [(0,), (1,)]


@pytest.mark.parametrize("senders, receivers", [(3, 2), (2, 3), (4, 2), (2, 4), (1, 3), (3, 1), (4, 3)])
def test_every_tile_goes_once_and_every_rank_takes_part(senders: int, receivers: int) -> None:
    m = TileMap(senders, receivers)
    pairs = {(i, j): m.tile(i, j) for i in range(senders) for j in range(receivers)}
    tiles = sorted(k for k in pairs.values() if k is not None)
    assert tiles == list(range(max(senders, receivers)))  # each tile crosses once: the value once over the link
    assert all(m.receivers_of(i) for i in range(senders)) and all(m.senders_of(j) for j in range(receivers))
    assert sorted(k for j in range(receivers) for k in m.held(j)) == tiles
    for j in range(receivers):
        assert [m.tile(i, j) for i in m.senders_of(j)] == list(m.held(j))
    back = m.reversed()  # the gradients: the same pairs, the same tiles
    assert all(back.tile(j, i) == k for (i, j), k in pairs.items())


def test_bounds_cover_the_value_and_differ_by_one_at_most() -> None:
    m = TileMap(3, 2)
    assert [m.bounds(10, k) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert m.cuts(3) and not m.cuts(2)  # fewer elements than tiles: the value crosses whole


def test_bad_sizes_and_ranks_are_named() -> None:
    with pytest.raises(ConfigError, match="senders=0"):
        TileMap(0, 2)
    with pytest.raises(ConfigError, match="no sender 2 or receiver 0"):
        TileMap(2, 1).tile(2, 0)


@pytest.mark.parametrize("senders, receivers", [(1, 2), (2, 1), (3, 2), (2, 4)])
def test_whole_sends_every_receiver_every_tile_and_gathers_nothing(senders: int, receivers: int) -> None:
    m = TileMap(senders, receivers, whole=True)
    assert m.num_tiles == senders and not m.gathers
    assert all(m.held(j) == tuple(range(senders)) for j in range(receivers))  # the whole value, no gather
    assert all(m.tile(i, j) == i for i in range(senders) for j in range(receivers))
    assert all(m.receivers_of(i) == tuple(range(receivers)) for i in range(senders))
    back = m.reversed()  # every sender gets the whole gradient: receiver j's tile j of `receivers`
    assert back.whole and back.num_tiles == receivers and not back.gathers
    assert all(back.held(i) == tuple(range(receivers)) for i in range(senders))


def test_crossing_time_prices_tiles_and_whole_and_picks_the_cheaper() -> None:
    from plait.cost.network import Link
    from plait.cost.tiles import crossing_time

    slow, fast = Link(1e-5, 1e9), Link(1e-5, 100e9)
    v = 8e6
    # 1 -> 2, tiles: two tiles of V/2 from the sender, then an all-gather of V/2 on the fast link
    assert crossing_time(v, 1, 2, slow, fast, whole=False) == pytest.approx(2 * (1e-5 + v / 2 / 1e9) + 1e-5 + v / 2 / 100e9)
    # whole: V to each receiver from the one sender
    assert crossing_time(v, 1, 2, slow, fast, whole=True) == pytest.approx(2e-5 + 2 * v / 1e9)
    # 2 -> 1 both ways alike: two tiles into the one receiver, nothing gathered
    assert crossing_time(v, 2, 1, slow, fast, False) == pytest.approx(crossing_time(v, 2, 1, slow, fast, True))
    # a slow link between the stages: gather locally; a collective as slow as gloo's on CPU: whole
    assert crossing_time(v, 1, 2, slow, fast, False) < crossing_time(v, 1, 2, slow, fast, True)
    slow_local = Link(1e-3, 1e9)
    assert crossing_time(1e3, 1, 2, slow, slow_local, False) > crossing_time(1e3, 1, 2, slow, slow_local, True)
