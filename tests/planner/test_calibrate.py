"""Calibration: the least-squares fit is exact on a line; two gloo ranks measure (links, all-reduce, a
hand-over's CPU time) and agree."""

from __future__ import annotations

import pytest

from plait.planner.calibrate import fit_link
from tests.harness import run_ranks


def test_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [1e3, 1e4, 1e5, 1e6]
    link = fit_link(sizes, [20e-6 + n / 2e9 for n in sizes])
    assert link.latency_s == pytest.approx(20e-6) and link.bandwidth == pytest.approx(2e9)
    flat = fit_link([1e3, 1e6], [5e-5, 5e-5])  # no cost per byte: latency only
    assert flat.latency_s == pytest.approx(5e-5) and flat.bandwidth >= 1e15
    with pytest.raises(ValueError, match="two or more"):
        fit_link([1.0], [1.0])


def test_the_bandwidth_comes_from_the_large_sizes_and_the_latency_from_the_small():
    sizes = [1e3, 1e4, 1e5, 2**20, 2**22, 2**25]
    line = fit_link(sizes, [20e-6 + n / 2e9 for n in sizes])
    assert line.latency_s == pytest.approx(20e-6, rel=1e-3) and line.bandwidth == pytest.approx(2e9, rel=1e-3)
    # Small messages in the caches move 4x faster than large ones from memory: one line through
    # all of them would price a 25 MiB gradient bucket at the small sizes' pace; the large ones
    # set the bandwidth, and the latency stays a small-message figure.
    bent = fit_link(sizes, [20e-6 + n / (4e9 if n < 2**20 else 1e9) for n in sizes])
    assert bent.bandwidth == pytest.approx(1e9, rel=1e-2) and 0 < bent.latency_s < 20e-6


def test_a_latency_only_the_small_sizes_meet_leaves_the_bandwidth_alone():
    # Small messages timed after compute wait ~2 ms for a rank to wake; the large ones, timed
    # between idle ranks, do not. Taking that latency off the large sizes' times would price
    # their bytes ~1.5x fast (a 128 MiB gradient sum at 2.3 GB/s where it ran at 1.45).
    sizes = [4e3, 6.4e4, 2.6e5, 2**20, 2**22, 2**23, 2**24, 2**25]
    times = [(2e-3 if n < 2**20 else 1e-4) + n / 1.45e9 for n in sizes]
    link = fit_link(sizes, times)
    assert link.bandwidth == pytest.approx(1.45e9, rel=1e-6)
    assert link.latency_s == pytest.approx(2e-3, rel=1e-6)


def measure(rank, world, cache_dir):
    import torch.distributed as dist

    from plait.planner.calibrate import calibrate

    dist.init_process_group("gloo")
    first = calibrate(cache_dir, repeats=2)
    again = calibrate(cache_dir, repeats=2)  # from the JSON rank 0 wrote
    return first.to_dict(), again.to_dict()


@pytest.mark.timeout(90)
def test_two_ranks_measure_the_same_link(tmp_path) -> None:
    results = run_ranks(2, measure, str(tmp_path), timeout=80)
    (first0, again0), (first1, _) = results
    assert first0 == first1  # rank 0's fit, broadcast
    intra = first0["intra"]
    assert intra["latency_s"] < 0.05 and intra["bandwidth"] > 1e6  # loopback: well above 1 MB/s
    reduce = first0["reduce_intra"]  # the all-reduce, timed and fitted on its own
    assert reduce["latency_s"] < 0.05 and reduce["bandwidth"] > 1e6 and reduce != intra
    assert first0["devices_per_node"] == 2 and again0 == first0
    # gloo on CPU ranks: a hand-over takes time from the ranks themselves (a send is not free)
    assert 1e-6 < first0["handover_cpu_s"] < 0.05
    assert len(list(tmp_path.glob("network-v7-gloo-2-2-*.json"))) == 1


def chain_with_a_slow_rank(rank, world):
    import time

    import torch
    import torch.distributed as dist

    from plait.planner import calibrate

    dist.init_process_group("gloo")
    if rank == 1:  # this rank's compute between the all-reduces takes 30 ms longer (well above a loaded host's noise)
        fast = calibrate._matmuls

        def slow(count: int) -> None:
            fast(count)
            time.sleep(30e-3)

        calibrate._matmuls = slow
    added = calibrate._in_chain(torch.zeros(256), dist.group.WORLD, repeats=3)
    dist.destroy_process_group()
    return added


@pytest.mark.timeout(90)
def test_an_all_reduce_in_a_chain_pays_the_other_ranks_slower_compute() -> None:
    # what the all-reduce adds to rank 0's chain includes the wait for rank 1's 30 ms more per link,
    # which an all-reduce timed after a barrier leaves out; rank 1, the slow one, waits for no one
    fast_rank, slow_rank = run_ranks(2, chain_with_a_slow_rank, timeout=80)
    assert fast_rank > 20e-3 and fast_rank > slow_rank + 15e-3, (fast_rank, slow_rank)
