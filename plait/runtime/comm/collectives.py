"""The collectives around a step: initial parameter broadcast, tied-gradient sums, state gathering."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from plait.cost.buckets import ALONE_BYTES
from plait.runtime.comm.waiting import finish
from plait.tensor_parts import part_size, whole_of, whole_shape

__all__ = ["local_device", "make_group", "sum_floats", "failed_ranks", "max_floats", "start_sum_floats", "broadcast_tensors", "TiedGradients",
           "gather_state_dict", "gather_parts_to_first", "whole_split_tensors", "broadcast_json", "all_gather_text"]


def local_device() -> torch.device:
    """Where this rank computes: its own CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_group(ranks: Sequence[int]) -> Any:
    """A process group of `ranks`; every rank must make every group, in the same order.

    The whole world is the default group itself: a second group over the same ranks would bring
    its own gloo threads and sockets, competing with the compute for the cores."""
    members = sorted(set(ranks))
    if members == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(members)


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: Any,
                      chunk_bytes: int = 64 * 2**20, alone_bytes: int = ALONE_BYTES) -> None:
    """`tensors` (the same shapes on every rank of `group`) from rank `src` to the others, in place.

    A contiguous tensor of at least `alone_bytes` goes where it lies, one broadcast of its own (the
    gradient buckets' rule); the others go in flat buffers of one dtype of at most `chunk_bytes`
    each. Copying a large tensor into a buffer and back costs the sender and every receiver a
    fresh allocation and two passes over its bytes (ZeRO's 67 MB per owner on 2 gloo ranks: 41-48
    ms a broadcast in a step, 20 ms in place)."""
    me = dist.get_rank()

    def alone(t: torch.Tensor) -> bool:
        return t.nbytes >= alone_bytes and t.is_contiguous()

    chunks: list[list[torch.Tensor]] = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        chunks += [[t] for t in same if alone(t)]
        chunk: list[torch.Tensor] = []
        size = 0
        for t in (t for t in same if not alone(t)):
            if chunk and size + t.nbytes > chunk_bytes:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(t)
            size += t.nbytes
        if chunk:
            chunks.append(chunk)
    with torch.no_grad():
        for chunk in chunks:
            if len(chunk) == 1 and chunk[0].is_contiguous():
                dist.broadcast(chunk[0].detach(), src, group=group)
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in chunk]) if me == src else \
                torch.empty(sum(t.numel() for t in chunk), dtype=chunk[0].dtype, device=chunk[0].device)
            dist.broadcast(flat, src, group=group)
            if me != src:
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


class TiedGradients:
    """Sums the gradients of parameters replicated on several stages (nkflow layer reuse, §3.4.3).

    Every rank makes the same groups in the same order, as `new_group` requires. An entry's
    optional third item: ranks of its group that add zeros (they hold a copy of another's value:
    the tp ranks of a stage holding a tied parameter whole, `plait.runtime.widths.stage_widths`).
    """

    def __init__(self, tied: Sequence[tuple[Any, ...]], rank: int):
        self._mine: list[tuple[nn.Parameter, Any, int]] = []  # (parameter, its group, its first holder)
        self._silent: set[int] = set()  # id(parameter) whose gradient this rank adds as zeros
        for param, ranks, *silent in tied:
            group = make_group(ranks)
            if rank in ranks:
                self._mine.append((param, group, min(ranks)))
                if silent and rank in silent[0]:
                    self._silent.add(id(param))

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The tied parameters this rank holds."""
        return [param for param, _, _ in self._mine]

    def broadcast(self) -> None:
        """Each tied parameter from its first holder to the others (start-up: equal everywhere)."""
        for param, group, first in self._mine:
            broadcast_tensors([param], first, group)

    def sum(self) -> None:
        """All-reduce (sum) each tied parameter's gradient over the ranks that hold it."""
        for param, group, _ in self._mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif id(param) in self._silent:
                param.grad.zero_()
            finish(dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group, async_op=True))


def gather_state_dict(net: nn.Module, owner_of: dict[int, int],
                      parts: Mapping[int, tuple[int, int, Sequence[int]]] | None = None) -> dict[str, torch.Tensor]:
    """The full state dict on every rank: each tensor broadcast from the rank that trains it.

    owner_of maps id(tensor) -> rank; tensors no stage uses come from rank 0. `parts`: a tensor
    split over tp ranks, id -> (dim, blocks, the rank of each part): each part broadcast from its
    rank, then joined.
    """
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, t in net.state_dict(keep_vars=True).items():
        if id(t) not in done:  # a meta model's tensors other ranks own are still on meta here
            split = (parts or {}).get(id(t))
            if split is not None:
                done[id(t)] = _gather_parts(t, *split)
            else:
                value = torch.empty(t.shape, dtype=t.dtype, device=local_device()) if t.is_meta else t.detach().clone()
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(value, owner_of.get(id(t), 0))
                done[id(t)] = value
        out[name] = done[id(t)]
    return out


def _gather_parts(t: torch.Tensor, dim: int, blocks: int, ranks: Sequence[int]) -> torch.Tensor:
    """A tensor split over `ranks` (tensor parallelism), whole on every rank."""
    shape = list(whole_shape(t))
    pieces = []
    for u, r in enumerate(ranks):  # (a part's rows: n // tp, or uneven where tp does not divide n)
        shape[dim] = part_size(whole_shape(t)[dim], u, len(ranks))
        piece = t.detach().clone() if dist.get_rank() == r else torch.empty(shape, dtype=t.dtype, device=local_device())
        dist.broadcast(piece, r)
        pieces.append(piece)
    return whole_of(pieces, dim, blocks)


def gather_parts_to_first(t: torch.Tensor, dim: int, blocks: int, ranks: Sequence[int], group: Any) -> torch.Tensor | None:
    """This rank's part of a tensor split over `ranks` (its tp group, whose members alone call
    this), whole on ranks[0]; None on the others."""
    first = dist.get_rank() == ranks[0]
    n, tp = whole_shape(t)[dim], len(ranks)
    mine = t.detach()
    if n % tp and mine.shape[dim] < -(-n // tp):  # uneven parts: padded to the first's rows (gloo gathers equal sizes)
        pad = list(mine.shape)
        pad[dim] = -(-n // tp) - mine.shape[dim]
        mine = torch.cat([mine, mine.new_zeros(pad)], dim)
    parts = [torch.empty_like(mine) for _ in ranks] if first else None
    dist.gather(mine.contiguous(), parts, dst=ranks[0], group=group)
    if parts is None:
        return None
    return whole_of([p.narrow(dim, 0, part_size(n, u, tp)) for u, p in enumerate(parts)], dim, blocks)


def whole_split_tensors(net: nn.Module, parts: Mapping[int, tuple[int, int, Sequence[int]]],
                        group: Any) -> dict[str, torch.Tensor]:
    """The tensors split over this rank's tp group (`parts`: id -> dim, blocks, ranks), gathered
    one at a time in state-dict order: whole, by first name, on the group's first rank."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in net.state_dict(keep_vars=True).items():
        split = parts.get(id(t))
        if id(t) in seen or split is None or dist.get_rank() not in split[2]:
            continue
        seen.add(id(t))
        whole = gather_parts_to_first(t, *split, group)
        if whole is not None:
            out[name] = whole
    return out


def failed_ranks(failed: bool) -> list[int]:
    """The ranks on which `failed` is true, on every rank (each calls it once): so a rank that
    cannot go on makes every rank stop, instead of leaving the others waiting for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if failed else []
    flags = [0.0] * dist.get_world_size()
    flags[dist.get_rank()] = float(failed)
    return [r for r, v in enumerate(sum_floats(flags)) if v]


def sum_floats(values: list[float]) -> list[float]:
    """Element-wise sum of every rank's `values` (float64), returned on every rank."""
    return _reduce_floats(values, dist.ReduceOp.SUM)


def max_floats(values: list[float]) -> list[float]:
    """Element-wise maximum of every rank's `values` (float64), returned on every rank."""
    return _reduce_floats(values, dist.ReduceOp.MAX)


def _reduce_floats(values: list[float], op: Any) -> list[float]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=local_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def start_sum_floats(values: list[float]) -> Callable[[], list[float]]:
    """`sum_floats` started now (all_reduce async_op) and finished by calling the result."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return lambda: list(values)
    t = torch.tensor(values, dtype=torch.float64, device=local_device())
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)

    def summed() -> list[float]:
        finish(work)
        return t.tolist()

    return summed


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank `src`'s JSON-serialisable `value` on every rank: UTF-8 bytes on the wire, never pickle."""
    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=local_device())
    dist.broadcast(size, src)
    body = _bytes_tensor(data, int(size))
    dist.broadcast(body, src)
    return json.loads(_bytes_of(body))


def all_gather_text(text: str) -> list[str]:
    """Every rank's `text`, in rank order, on every rank (UTF-8 bytes on the wire, never pickle)."""
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=local_device())
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    mine = _bytes_tensor(data, max(int(n) for n in sizes))  # padded: all_gather takes equal sizes
    everyone = [torch.zeros_like(mine) for _ in sizes]
    dist.all_gather(everyone, mine)
    return [_bytes_of(t[: int(n)]).decode() for t, n in zip(everyone, sizes)]


def _bytes_tensor(data: bytes, length: int) -> torch.Tensor:
    """`data` as a uint8 tensor of `length` bytes (zero-padded) on this rank's device."""
    return torch.tensor(list(data.ljust(length, b"\0")), dtype=torch.uint8, device=local_device())


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().tolist())
