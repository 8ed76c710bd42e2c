"""The point-to-point protocol between neighbouring stages: a description once, then raw tensors.

A message is a list of values (tensors, Python numbers, None, tuples/lists/dicts of them).
The first message for a *key* (direction, boundary, train/eval, the micro-batch's input shapes)
starts with a description, so the receiver can allocate buffers; later ones carry only data::

    first time:  header int64[2] = (len(desc), len(spec))
                 desc   int64[...] = per leaf: kind, dtype, requires_grad, ndim, *shape, *order
                 spec   uint8[...] = the pytree structure as JSON (never pickle)
    every time:  one tensor per tensor leaf, plus one float64 tensor of the Python-number leaves

A tensor travels in its memory order (`order`: its dimensions from the largest stride to the
smallest) and is rebuilt with the same strides, so a stage that receives a transposed activation
can `view` it after transposing it back, as in one process. Gradients travel contiguous.

A message's small tensors (its number leaves among them) travel in one shared buffer, each copied
out of it on arrival (`plait.runtime.comm.packing`): one isend instead of one per leaf.

Sends are `isend` and never block the schedule (blocking sends deadlock 1F1B on gloo); a send's
buffers are kept until `drain` waits for them. Every wait has a timeout.

gloo moves a message only once both sides have posted it: the sender announces it, the receiver
answers when its receive is posted, then the data flows. A receive posted only when its action
comes up therefore puts a round trip on the critical path; `post_recv` posts it ahead, so the
data flows the moment the peer sends it::

    posted late:   rank 0 isend --ready--> rank 1 (busy) ... irecv --ready--> rank 0 --data--> rank 1
    posted ahead:  rank 1 irecv --ready--> rank 0 ... isend --data--> rank 1 (already there)

Between CPU ranks of one host the same tensors go through shared memory instead (`Rings`,
rings.py): a send is a copy into the peer's ring, a receive a copy out of it, with no thread to
wake and nothing to yield to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from plait.runtime.comm.packing import Layout, Spec, layout, pack, receive_buffers, unpack
from plait.runtime.comm.rings import Rings

__all__ = ["Wire", "WireTimeout", "Description", "as_received", "describe", "dim_order", "inverse_order"]

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_TENSOR, _FLOAT, _NONE, _INT, _BOOL = 0, 1, 2, 3, 4
_NUMBERS = (_FLOAT, _INT, _BOOL)


class WireTimeout(RuntimeError):
    """A receive or send did not complete in time, or the peer went away."""


@dataclass(frozen=True)
class Description:
    """What a message holds: one entry per leaf, and the structure that rebuilds the values."""

    kinds: tuple[int, ...]
    dtypes: tuple[torch.dtype | None, ...]
    shapes: tuple[tuple[int, ...], ...]
    requires_grad: tuple[bool, ...]
    spec: pytree.TreeSpec
    orders: tuple[tuple[int, ...], ...] = ()  # per leaf: its dimensions, outermost in memory first

    @property
    def tensor_positions(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == _TENSOR]

    @cached_property
    def specs(self) -> list[Spec]:
        """What travels: each tensor leaf in its memory order, then one float64 tensor of the
        number leaves (if any)."""
        out: list[Spec] = [(dtype, tuple(shape[d] for d in order))
                           for kind, dtype, shape, order in zip(self.kinds, self.dtypes, self.shapes, self.orders)
                           if kind == _TENSOR and dtype is not None]
        count = sum(k in _NUMBERS for k in self.kinds)
        return out + [(torch.float64, (count,))] if count else out


def _leaf_kind(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return _TENSOR
    if x is None:
        return _NONE
    if isinstance(x, bool):
        return _BOOL
    if isinstance(x, int):
        return _INT
    if isinstance(x, float):
        return _FLOAT
    raise TypeError(
        f"plait can send tensors, numbers and None between stages, not {type(x).__name__}"
    )


def dim_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimensions from the largest stride to the smallest (ties in dimension order): a
    contiguous tensor's is (0, 1, ..., n-1), a transposed matrix's (1, 0)."""
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda d: -strides[d]))


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes `tensor.permute(order)` (a value rebuilt in its sender's memory order)."""
    out = [0] * len(order)
    for position, d in enumerate(order):
        out[d] = position
    return tuple(out)


def _flatten(values: list[Any]) -> tuple[list[Any], pytree.TreeSpec]:
    # torch.Size travels as a tuple of ints.
    values = [tuple(v) if isinstance(v, torch.Size) else v for v in values]
    return pytree.tree_flatten(values)


def describe(values: list[Any]) -> Description:
    """The description of a message, as the sender sees it."""
    leaves, spec = _flatten(values)
    kinds = tuple(_leaf_kind(x) for x in leaves)
    return Description(
        kinds,
        tuple(x.dtype if k == _TENSOR else None for x, k in zip(leaves, kinds)),
        tuple(tuple(x.shape) if k == _TENSOR else () for x, k in zip(leaves, kinds)),
        tuple(bool(k == _TENSOR and x.requires_grad) for x, k in zip(leaves, kinds)),
        spec,
        tuple(dim_order(x) if k == _TENSOR else () for x, k in zip(leaves, kinds)),
    )


def _rebuilt(t: torch.Tensor, order: Sequence[int], grad: bool) -> torch.Tensor:
    """A tensor that arrived in memory order `order`, back in its sender's dimensions and strides,
    a leaf that requires grad where the sender's tensor did."""
    if tuple(order) != tuple(range(len(order))):
        t = t.permute(inverse_order(order))
    return t.requires_grad_() if grad else t


def as_received(values: list[Any]) -> list[Any]:
    """`values` exactly as `Wire.recv` on another rank hands them over, with no transport: new
    leaves (detached, dense in the sender's memory order), requiring grad where the sent tensor
    did; numbers as the float64 round trip gives them back; the structure through its JSON form.
    The planner's profiler runs a stage on these, so it runs what the runtime runs."""
    desc = describe(values)
    leaves, _ = _flatten(values)
    out: list[Any] = []
    for x, kind, grad, order in zip(leaves, desc.kinds, desc.requires_grad, desc.orders):
        if kind == _TENSOR:
            out.append(_rebuilt(x.detach().permute(order).clone(memory_format=torch.contiguous_format),
                                order, grad))
        elif kind in _NUMBERS:
            out.append(_CAST[kind](float(x)))
        else:
            out.append(None)
    return list(pytree.tree_unflatten(out, pytree.treespec_loads(pytree.treespec_dumps(desc.spec))))


class Wire:
    """Sends and receives stage messages for one rank."""

    def __init__(self, timeout_s: float, device: torch.device | None = None, group: Any = None,
                 rings: Rings | None = None):
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device or torch.device("cpu")
        self.group = group
        self.rings = rings if group is None else None  # shared memory to the peers of this host (rings.py)
        self._pending: list[tuple[Any, Any]] = []  # (work, buffer kept alive)
        self._sent: dict[Hashable, Description] = {}
        self._received: dict[Hashable, Description] = {}
        # (peer, tag) -> the receives posted ahead: buffers, works, and what unpacks them
        self._posted: dict[tuple[int, int], tuple[list[torch.Tensor], list[Any], list[Spec], Layout]] = {}
        self._layouts: dict[tuple[Spec, ...], Layout] = {}

    def _layout(self, specs: Sequence[Spec]) -> Layout:
        key = tuple(specs)
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = layout(key)
        return found

    # -- sending -------------------------------------------------------------------------------

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        rings = self._rings_to(peer)
        if rings is not None:
            self._pending.append((rings.isend(tensor, peer, tag), tensor))
        else:
            self._pending.append((dist.isend(tensor, peer, group=self.group, tag=tag), tensor))

    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        rings = self._rings_to(peer)
        if rings is not None:
            return rings.irecv(tensor, peer, tag)
        return dist.irecv(tensor, peer, group=self.group, tag=tag)

    def _handover(self, peer: int) -> None:
        if self._rings_to(peer) is None:
            _handover()

    def _rings_to(self, peer: int) -> Rings | None:
        """The rings messages with `peer` go through (a rank of this host), or None: gloo."""
        return self.rings if self.rings is not None and self.rings.reaches(peer) else None

    def send(self, values: list[Any], peer: int, key: Hashable, tag: int) -> Description:
        """Send `values` to `peer`; describe them first if this key is new."""
        leaves, _ = _flatten(values)
        desc = self._sent.get((peer, key))
        if desc is None:
            desc = describe(values)
            self._sent[(peer, key)] = desc
            self._send_description(desc, peer, tag)
        self._send_leaves(leaves, desc, peer, tag)
        self._handover(peer)
        return desc

    def _send_description(self, desc: Description, peer: int, tag: int) -> None:
        body: list[int] = []
        for kind, dtype, shape, grad, order in zip(desc.kinds, desc.dtypes, desc.shapes, desc.requires_grad,
                                                   desc.orders):
            body += [kind, _CODE[dtype] if dtype is not None else -1, int(grad), len(shape), *shape, *order]
        spec = pytree.treespec_dumps(desc.spec).encode()
        self._isend(torch.tensor([len(body), len(spec)], dtype=torch.int64, device=self.device), peer, tag)
        if body:
            self._isend(torch.tensor(body, dtype=torch.int64, device=self.device), peer, tag)
        self._isend(torch.frombuffer(bytearray(spec), dtype=torch.uint8).to(self.device), peer, tag)

    def _send_leaves(self, leaves: list[Any], desc: Description, peer: int, tag: int) -> None:
        tensors, numbers = [], []
        for x, kind, shape, order in zip(leaves, desc.kinds, desc.shapes, desc.orders):
            if kind == _TENSOR:
                if tuple(x.shape) != shape:
                    raise WireTimeout(
                        f"a tensor of shape {tuple(x.shape)} was sent where the agreed shape is "
                        f"{shape}; shapes must be a function of the input shapes"
                    )
                tensors.append(x.detach().permute(order))  # contiguous, no copy, for a dense tensor
            elif kind in _NUMBERS:
                numbers.append(float(x))
        if numbers:
            tensors.append(torch.tensor(numbers, dtype=torch.float64, device=self.device))
        for t in pack(tensors, self._layout(desc.specs)):
            self._isend(t, peer, tag)

    def send_tensors(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        """Send tensors whose shapes the peer already knows (gradients)."""
        tensors = [t.detach().contiguous() for t in tensors]
        for t in pack(tensors, self._layout([(t.dtype, tuple(t.shape)) for t in tensors])):
            self._isend(t, peer, tag)
        self._handover(peer)

    def drain(self) -> None:
        """Wait for every send of this step to complete."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)

    def abandon(self) -> None:
        """Forget unfinished sends and posted receives after a failure (their peer may be gone)."""
        self._pending.clear()
        self._posted.clear()

    # -- receiving -----------------------------------------------------------------------------

    def _empty(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(count, dtype=dtype, device=self.device)

    def _recv(self, tensor: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        self._wait(self._irecv(tensor, peer, tag))
        return tensor

    def _wait(self, work: Any) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise WireTimeout(str(e).splitlines()[0] if str(e) else type(e).__name__) from e

    def post_recv(self, peer: int, key: Hashable, tag: int) -> bool:
        """Post now the receives of message `key`, if its description is known; False if not."""
        desc = self._received.get((peer, key))
        if desc is not None and (peer, tag) not in self._posted:
            self._post(desc.specs, peer, tag)
        return desc is not None

    def post_recv_grads(self, peer: int, key: Hashable, tag: int, extra: Sequence[Spec] = ()) -> bool:
        """Post now the receives of the gradients `peer` returns for message `key` sent to it
        (followed by tensors of the `extra` specs, where the sender appends some); False if that
        message has not been sent yet (its shapes are unknown)."""
        desc = self._sent.get((peer, key))
        if desc is not None and (peer, tag) not in self._posted:
            self._post([(dtype, shape) for kind, dtype, shape, grad in
                        zip(desc.kinds, desc.dtypes, desc.shapes, desc.requires_grad)
                        if kind == _TENSOR and grad and dtype is not None] + list(extra), peer, tag)
        return desc is not None

    def post_tensors(self, like: list[torch.Tensor], peer: int, tag: int) -> None:
        """Post now the receives of tensors shaped as `like` (a message whose shapes the caller
        knows; `recv_tensors` takes them), unless (peer, tag) is posted already."""
        if (peer, tag) not in self._posted:
            self._post([(t.dtype, tuple(t.shape)) for t in like], peer, tag)

    def _post(self, specs: list[Spec], peer: int, tag: int) -> None:
        plan = self._layout(specs)
        buffers = receive_buffers(specs, plan, self.device)
        works = [self._irecv(b, peer, tag) for b in buffers]
        self._posted[(peer, tag)] = (buffers, works, specs, plan)

    def _take(self, peer: int, tag: int) -> list[torch.Tensor] | None:
        """The tensors of the receives posted ahead for (peer, tag) once they arrive, or None."""
        posted = self._posted.pop((peer, tag), None)
        if posted is None:
            return None
        buffers, works, specs, plan = posted
        for work in works:
            self._wait(work)
        return unpack(buffers, specs, plan)

    def _receive(self, specs: list[Spec], peer: int, tag: int) -> list[torch.Tensor]:
        """Tensors of these specs from `peer`: posted ahead, or posted now and waited for."""
        got = self._take(peer, tag)
        if got is None:
            self._post(specs, peer, tag)
            got = self._take(peer, tag)
            assert got is not None
        return got

    def recv(self, peer: int, key: Hashable, tag: int) -> tuple[list[Any], Description]:
        """Receive one message from `peer`; tensors that required grad there require grad here."""
        desc = self._received.get((peer, key))
        if desc is None:
            desc = self._recv_description(peer, tag)
            self._received[(peer, key)] = desc
        filled = iter(self._receive(desc.specs, peer, tag))
        leaves: list[Any] = []
        for kind, grad, order in zip(desc.kinds, desc.requires_grad, desc.orders):
            if kind == _TENSOR:
                leaves.append(_rebuilt(next(filled), order, grad))  # arrived in memory order
            else:
                leaves.append(None)
        count = sum(k in _NUMBERS for k in desc.kinds)
        if count:
            numbers = iter(next(filled).tolist())
            leaves = [
                _CAST[k](next(numbers)) if k in _NUMBERS else x for x, k in zip(leaves, desc.kinds)
            ]
        return pytree.tree_unflatten(leaves, desc.spec), desc

    def _recv_description(self, peer: int, tag: int) -> Description:
        header = self._recv(self._empty(2, torch.int64), peer, tag).tolist()
        body = self._recv(self._empty(header[0], torch.int64), peer, tag).tolist() if header[0] else []
        spec = bytes(self._recv(self._empty(header[1], torch.uint8), peer, tag).tolist())
        kinds, dtypes, shapes, grads, orders = [], [], [], [], []
        i = 0
        while i < len(body):
            kind, code, grad, ndim = body[i : i + 4]
            kinds.append(kind)
            dtypes.append(_DTYPES[code] if code >= 0 else None)
            grads.append(bool(grad))
            shapes.append(tuple(body[i + 4 : i + 4 + ndim]))
            orders.append(tuple(body[i + 4 + ndim : i + 4 + 2 * ndim]))
            i += 4 + 2 * ndim
        return Description(
            tuple(kinds), tuple(dtypes), tuple(shapes), tuple(grads),
            pytree.treespec_loads(spec.decode()), tuple(orders),
        )

    def recv_tensors(self, like: list[torch.Tensor], peer: int, tag: int) -> list[torch.Tensor]:
        """Receive tensors shaped like `like` (gradients of what this rank sent)."""
        # Contiguous whatever the strides of `like` (a transposed activation's gradient):
        # the backend receives into contiguous memory only.
        return self._receive([(t.dtype, tuple(t.shape)) for t in like], peer, tag)


_CAST = {_FLOAT: float, _INT: int, _BOOL: bool}


def _handover() -> None:
    """Yield the CPU once after a message's sends.

    gloo pairs a send with the peer's posted receive, and pushes the data, on its own device
    thread. When every core is busy computing (a pipeline rank per core), that thread waits for
    the compute thread's time slice to end, and the peer waits with it: a 1F1B step on two CPU
    ranks stalled for milliseconds at a time. Yielding once lets the device thread run at once
    (docs/benchmarks.md, "The send yield", has the probe that measured it).
    """
    time.sleep(0)
