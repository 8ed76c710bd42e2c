"""Measuring the backend's latency and bandwidth: timed ping-pongs between two ranks, fitted.

One message of n bytes costs alpha + n / beta (`plait.cost.network.Link`). Rank a sends n
bytes to rank b, which sends them back; half the round trip, median of `repeats`, for sizes
from 1 KiB to 32 MiB (past the gradient buckets' 25 MiB). beta is the slope of the sizes of 1 MiB
and more (the least-squares line through them alone), where the bytes cost more than the latency;
alpha the median, over the smaller sizes, of what their times leave beyond n / beta (one line
fitted through all would let the large sizes' noise set alpha and the small sizes' set beta, and
the caches bend the line between them; taking the small sizes' alpha off the large sizes' times
would let a latency only small messages meet inflate beta). The sizes below 1 MiB, which set alpha, are timed as a
step meets them -- right after both ranks computed -- and averaged over four times the repeats:
on CPU ranks a message or collective now and then waits a scheduler tick for a thread pushed off
its core, a tail that a step's sum of them pays and a median leaves out (2 gloo ranks, 1-256 KiB:
a ping-pong's one way 0.5-1.1 ms mean after compute, 0.13-0.24 ms median between idle ranks; a 64
KiB all-reduce 0.8-1.9 ms mean after compute, 0.4 ms median idle). An all-reduce is timed on
the same pair, waited for as the runtime waits (`plait.runtime.comm.waiting`) -- below 1 MiB as what
it adds to a chain of equal compute on both ranks, as a tensor-parallel step meets it
(`_in_chain`, twice `repeats` blocks of each kind) -- and fitted to the ring formula 2(p-1) alpha
+ 2(p-1) n / (p beta) (Thakur et al. 2005): a library's collective has costs of its own that a ping-pong does not show
(docs/benchmarks.md has a measured case). On CPU ranks (gloo) a hand-over also takes time from the ranks themselves:
`measure_handover` times, while both ranks compute as pipeline stages do, the sender's send and
yield to the transport thread and the receiver's posting of its receive. Both are measured on gloo even
where a pipeline's messages go by shared memory (`plait.runtime.comm.rings`, CPU ranks of one host):
a ring's hand-over is several times cheaper, but the planner does not price the runtime's own
per-action cost yet, and with the ring's hand-over alone it chose 2 chunks per rank (interleaved,
twice the actions) over ZB-H1, measured 13.15 against 10.32 ms (docs/benchmarks.md, "Shared-memory
rings"); gloo's dearer hand-over stands for that cost until it is priced. Every rank of the group calls `measure_link` and
`measure_all_reduce` (the others only wait for the broadcast result); `calibrate` measures a
pair inside a node and, on several nodes, a pair across, and caches the `Network` as JSON keyed
by backend and hosts.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from plait.cost.network import Link, Network
from plait.job.ranks import local_world_size, threads_per_rank
from plait.runtime.comm.collectives import all_gather_text, broadcast_json, make_group
from plait.runtime.comm.waiting import finish

__all__ = ["fit_link", "measure_link", "measure_all_reduce", "measure_handover", "calibrate", "measure_here"]

# 1 KiB .. 4 MiB, then to 32 MiB: a gradient bucket's size (25 MiB cap), a ZeRO owner's broadcast
SIZES = tuple(2**k for k in range(10, 23, 2)) + (2**23, 2**24, 2**25)
LARGE = 2**20  # sizes from here fit the bandwidth; those below, the latency
REDUCE_SIZES = (2**12, 2**16, 2**18) + tuple(s for s in SIZES if s >= LARGE)  # the all-reduce's: the chain takes time
HANDOVER_BYTES = 64 * 1024
BUSY_S = 1e-3  # compute around each timed hand-over, as a stage computes around its sends
IN_STEP_REPEATS = 4  # times `repeats` ping-pongs of each small size: their mean has a long tail
CHAIN_REPEATS = 2  # times `repeats` blocks of each kind in a small all-reduce's chain: with five, five
# calibrations in one job fitted an all-reduce's fixed cost at 0.72-2.28 ms; with ten, 1.63-1.86 (2 gloo ranks)
CHAIN = 6  # links of compute and all-reduce in each timed block (`_in_chain`)
CHAIN_BUSY_S = 5e-3  # compute before each: a CPU rank's layer between its tp collectives (GPT-2 256 wide: ~5 ms)


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """alpha + n / beta through the measurements. With two or more sizes of at least LARGE bytes
    and some smaller: 1 / beta = the slope of the least-squares line through the large sizes
    alone (their bytes' cost; a latency the small sizes meet, e.g. a rank's wake-up after compute,
    does not enter it), alpha the median, over the smaller sizes, of t - n / beta (>= 0).
    Otherwise the least-squares line through all of them (latency clamped at >= 0)."""
    n = len(sizes)
    if n < 2 or len(seconds) != n:
        raise ValueError(f"need two or more (size, seconds) pairs, got {n} sizes, {len(seconds)} times")
    large = [(x, y) for x, y in zip(sizes, seconds) if x >= LARGE]
    small = [(x, y) for x, y in zip(sizes, seconds) if x < LARGE]
    if len(large) >= 2 and small:
        slope = _slope(large)
        if slope <= 0:  # the large sizes' noise hides their slope: their bytes over their time
            slope = sum(y for _, y in large) / sum(x for x, _ in large)
        if slope > 0:
            latency = max(statistics.median(y - x * slope for x, y in small), 0.0)
            return Link(latency, 1.0 / slope)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    slope = _slope(list(zip(sizes, seconds)))
    if slope <= 0:  # no measurable cost per byte: latency-bound, bandwidth beyond measuring
        return Link(max(mean_y, 0.0), 1e15)
    return Link(max(mean_y - slope * mean_x, 0.0), 1.0 / slope)


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y on x through `points` (0 where every x is the same)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx > 0 else 0.0


def measure_link(rank_a: int = 0, rank_b: int = 1, sizes: Sequence[int] = SIZES,
                 repeats: int = 5) -> Link:
    """The link between `rank_a` and `rank_b`, fitted from ping-pongs; every rank returns it."""
    me = dist.get_rank()
    if me not in (rank_a, rank_b):
        return _fitted_on(rank_a, sizes, [0.0] * len(sizes), latencies=1)

    def ping_pong(buffer: torch.Tensor) -> float:
        start = time.perf_counter()
        if me == rank_a:
            dist.send(buffer, rank_b)
            dist.recv(buffer, rank_b)
        else:
            dist.recv(buffer, rank_a)
            dist.send(buffer, rank_a)
        return (time.perf_counter() - start) / 2

    small: dict[int, float] = {}
    for size in (s for s in sizes if s < LARGE):
        buffer = torch.zeros(size, dtype=torch.uint8)
        samples = []
        for k in range(_rounds(size, repeats)):  # the first sets the connection up
            _compute(BUSY_S)  # a hand-over as a pipeline meets it: after compute
            taken = ping_pong(buffer)
            if k:
                samples.append(taken)
        small[size] = _typical(size, samples)
    large = _round_robin([s for s in sizes if s >= LARGE], repeats,
                         lambda size: torch.zeros(size, dtype=torch.uint8), ping_pong)
    times = [small[s] if s < LARGE else large[s] for s in sizes]
    return _fitted_on(rank_a, sizes, times, latencies=1)


def _round_robin(sizes: Sequence[int], repeats: int, make: Callable[[int], torch.Tensor],
                 timed: Callable[[torch.Tensor], float]) -> dict[int, float]:
    """Each size's median over `repeats` timings (after one to set up), the sizes taken in turn
    in every round: a slow spell of a shared host then slows every size alike rather than bending
    the line through them (the bandwidth is its slope)."""
    buffers = {size: make(size) for size in sizes}
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    for k in range(repeats + 1):
        for size in sizes:
            taken = timed(buffers[size])
            if k:
                samples[size].append(taken)
    return {size: statistics.median(samples[size]) for size in sizes}


def measure_all_reduce(rank_a: int = 0, rank_b: int = 1, sizes: Sequence[int] = REDUCE_SIZES,
                       repeats: int = 5) -> Link:
    """The link a SUM all-reduce between `rank_a` and `rank_b` runs at, fitted to the ring
    formula (p = 2: 2 alpha + n / beta); every rank of the job calls it and returns it."""
    group = make_group([rank_a, rank_b])
    me = dist.get_rank()
    times: list[float] = []
    if me in (rank_a, rank_b):

        def reduced(buffer: torch.Tensor) -> float:
            dist.barrier(group)
            start = time.perf_counter()
            finish(dist.all_reduce(buffer, group=group, async_op=True))  # waited for as the runtime waits
            return time.perf_counter() - start

        # below LARGE as a tensor-parallel step meets them: between its layers' compute
        small = {s: _in_chain(torch.zeros(s // 4, dtype=torch.float32), group, CHAIN_REPEATS * repeats)
                 for s in sizes if s < LARGE}
        large = _round_robin([s for s in sizes if s >= LARGE], repeats,
                             lambda size: torch.zeros(size // 4, dtype=torch.float32), reduced)
        times = [small[s] if s < LARGE else large[s] for s in sizes]
    link = _fitted_on(rank_a, sizes, times, latencies=2)  # intercept 2 alpha, slope 1 / beta
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)
    return link


def measure_handover(rank_a: int = 0, rank_b: int = 1, nbytes: int = HANDOVER_BYTES, repeats: int = 20) -> float:
    """CPU time a hand-over takes at each end (`Network.handover_cpu_s`), every rank returns it:
    rank b posts a receive (timed), says so, and computes; rank a computes, then sends and yields
    once to the transport thread as the runtime's wire does (timed), and computes again. The
    mean of the two medians."""
    me = dist.get_rank()
    mean = torch.zeros(1, dtype=torch.float64)
    if me in (rank_a, rank_b):
        buffer, ready = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1)
        samples = []
        for k in range(repeats + 1):  # the first one sets the pair's connection up
            if me == rank_b:
                start = time.perf_counter()
                work = dist.irecv(buffer, rank_a)
                taken = time.perf_counter() - start
                dist.send(ready, rank_a)
                _compute(2 * BUSY_S)
            else:
                dist.recv(ready, rank_b)
                _compute(BUSY_S)
                start = time.perf_counter()
                work = dist.isend(buffer, rank_b)
                time.sleep(0)
                taken = time.perf_counter() - start
                _compute(BUSY_S)
            assert work is not None
            work.wait()
            if k:
                samples.append(taken)
        mean[0] = statistics.median(samples) / 2
        if me == rank_a:
            theirs = torch.zeros(1, dtype=torch.float64)
            dist.recv(theirs, rank_b)
            mean += theirs
        else:
            dist.send(mean, rank_a)
    dist.broadcast(mean, rank_a)
    return float(mean[0])


def _in_chain(buffer: torch.Tensor, group: Any, repeats: int) -> float:
    """What an all-reduce of `buffer` adds to a chain of compute, as a tensor-parallel step has them:
    blocks of CHAIN x (the same fixed work on both ranks, then the all-reduce) against blocks of
    the work alone, alternating (the host's load drifts), `repeats` of each; the difference of
    their means per link. The chain's all-reduce also waits for the other rank's slower compute,
    and for gloo's threads to get a core back from it: costs a step pays and an all-reduce timed
    on its own leaves out. On 2 gloo ranks a 64 KiB all-reduce after a barrier and 1 ms of compute
    took 0.8 ms; in tensor-parallel steps (about 5-8 ms of compute between them) each added
    1.2-3 ms; in chains it added 0.7-2.2 ms after 2 ms of compute and 1.7-3.8 ms after 8 ms."""
    work = _work_for(CHAIN_BUSY_S, group)
    chained: list[float] = []
    alone: list[float] = []
    finish(dist.all_reduce(buffer, group=group, async_op=True))  # sets the group's connections up
    for k in range(2 * repeats):
        reduce = (k % 4) in (0, 3)  # with, without, without, with, ...
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(CHAIN):
            _matmuls(work)
            if reduce:
                finish(dist.all_reduce(buffer, group=group, async_op=True))  # waited for as the runtime waits
        (chained if reduce else alone).append((time.perf_counter() - start) / CHAIN)
    return max(statistics.mean(chained) - statistics.mean(alone), 0.0)


def _work_for(seconds: float, group: Any) -> int:
    """Products of `_matmuls` that take about `seconds` here: counted on the group's first rank and
    taken by all (equal work: a rank's slower compute then shows as the other's wait)."""
    agreed = torch.tensor([_compute(seconds)], dtype=torch.int64)
    dist.broadcast(agreed, dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0, group=group)
    return int(agreed[0])


def _matmuls(count: int) -> None:
    """`count` products of 128 x 128 matrices: fixed work."""
    a = torch.ones(128, 128)
    for _ in range(count):
        a = a @ a * 1e-3


def _rounds(size: int, repeats: int) -> int:
    """Timed rounds of a size, plus one to set up: IN_STEP_REPEATS x `repeats` below LARGE, whose
    mean has a long tail, else `repeats`."""
    return (IN_STEP_REPEATS * repeats if size < LARGE else repeats) + 1


def _typical(size: int, samples: Sequence[float]) -> float:
    """A size's time: below LARGE the mean (a step's sum of them pays the tail), else the median."""
    return statistics.mean(samples) if size < LARGE else statistics.median(samples)


def _compute(seconds: float) -> int:
    """Keep this rank's core busy with `_matmuls`' products for `seconds`; how many it did."""
    a, count = torch.ones(128, 128), 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = a @ a * 1e-3
        count += 1
    return count


def _fitted_on(rank_a: int, sizes: Sequence[int], times: Sequence[float], latencies: int) -> Link:
    """Rank `rank_a`'s fit of its `times`, whose intercept holds `latencies` alphas, on every rank."""
    fitted = torch.zeros(2, dtype=torch.float64)
    if dist.get_rank() == rank_a:
        line = fit_link([float(s) for s in sizes], times)
        fitted = torch.tensor([line.latency_s / latencies, line.bandwidth], dtype=torch.float64)
    dist.broadcast(fitted, rank_a)
    return Link(float(fitted[0]), float(fitted[1]))


def calibrate(cache_dir: str | os.PathLike[str] | None = None, repeats: int = 5) -> Network:
    """This job's `Network`, measured on its backend (every rank calls it; all get the result).

    Nodes are LOCAL_WORLD_SIZE consecutive ranks; each kind of link is measured twice, by
    ping-pongs (messages) and by all-reduces (collectives). With one rank there is nothing to measure:
    the loopback is taken as free (latency 0, bandwidth 1e15). Cached per backend, world size,
    node size and host names under `cache_dir`.
    """
    world = dist.get_world_size()
    per_node = local_world_size(world)
    hosts = all_gather_text(socket.gethostname())
    key = f"v7-{dist.get_backend()}-{world}-{per_node}-{'-'.join(sorted(set(hosts)))}"
    path = Path(cache_dir) / f"network-{key}.json" if cache_dir is not None else None
    stored = None
    if path is not None and dist.get_rank() == 0 and path.exists():
        stored = json.loads(path.read_text())
    stored = broadcast_json(stored, 0)  # one decision for all: measuring takes every rank
    if isinstance(stored, dict):
        return Network.from_dict(stored)
    if world == 1:
        free = Link(0.0, 1e15)
        network = Network(free, free, 1)
    else:
        intra = measure_link(0, 1, repeats=repeats) if per_node > 1 else None
        inter = measure_link(0, per_node, repeats=repeats) if world > per_node else None
        reduce_intra = measure_all_reduce(0, 1, repeats=repeats) if per_node > 1 else None
        reduce_inter = measure_all_reduce(0, per_node, repeats=repeats) if world > per_node else None
        # a copy engine moves a GPU's messages; on CPU ranks (gloo) the ranks' own cores do
        handover = measure_handover(0, 1 if per_node > 1 else per_node) if dist.get_backend() == "gloo" else 0.0
        network = Network(intra or inter or Link(0.0, 1e15), inter or intra or Link(0.0, 1e15),
                          per_node, reduce_intra, reduce_inter, handover)
    if path is not None and dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(network.to_dict()))
        tmp.replace(path)
    return network


def measure_here(local_ranks: int, repeats: int = 5) -> Network:
    """This host's `Network` as `calibrate` measures it in a job of `local_ranks` CPU (gloo) ranks
    here, with no job running: two processes are started for it, each with the threads one of
    `local_ranks` ranks gets (what `plait plan --model` prices with, as a job planning here would)."""
    if local_ranks < 2:
        free = Link(0.0, 1e15)
        return Network(free, free, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        spawn = multiprocessing.get_context("spawn")
        ranks = [spawn.Process(target=_measure_rank, args=(r, port, local_ranks, repeats, out)) for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(process.exitcode != 0 for process in ranks):
            raise RuntimeError(f"measuring this host's link failed (exit codes {[p.exitcode for p in ranks]}); "
                               "give --device cpu to price with the preset instead")
        network = Network.from_dict(json.loads((Path(out) / "network.json").read_text()))
    return replace(network, devices_per_node=local_ranks)


def _measure_rank(rank: int, port: int, local_ranks: int, repeats: int, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.set_num_threads(threads_per_rank(local_ranks))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        network = calibrate(repeats=repeats)
        if rank == 0:
            (Path(out) / "network.json").write_text(json.dumps(network.to_dict()))
    finally:
        dist.destroy_process_group()
