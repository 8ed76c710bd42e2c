"""The dtype a model computes in: its parameters held in it while it is captured or profiled, and its floating inputs cast.

A low-precision run (`Plan.precision` "bf16") computes each stage with a bf16 copy of its
parameters. The graph must be captured in that dtype too: torch.export records the dtypes it
saw (a Hugging Face model's `hidden.to(inputs_embeds.dtype)` becomes `to(float32)`), so a graph
captured in fp32 would turn bf16 activations back into fp32. `held_in` holds the model's floating
parameters in the dtype while the block runs -- the same parameter objects, so the graph reads
them by name as always -- and gives them their fp32 values back exactly after.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["DTYPES", "LOW_DTYPES", "dtype_of", "held_in", "cast_floating", "as_computed"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOW_DTYPES = tuple(d for d in DTYPES.values() if d != torch.float32)  # the 2-byte dtypes stages may compute in


def dtype_of(precision: str) -> torch.dtype:
    """The torch dtype of a `Plan.precision` / `Config.precision` name."""
    return DTYPES[precision]


@contextmanager
def held_in(net: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """`net`'s floating parameters hold `dtype` values inside the block (fp32: nothing changes);
    after it, each has its own values back (the same tensor, untouched)."""
    if dtype == torch.float32:
        yield
        return
    kept: list[tuple[nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    for p in net.parameters():
        if id(p) in seen or not p.is_floating_point() or p.dtype == dtype:
            continue
        seen.add(id(p))
        kept.append((p, p.data))
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in kept:
            p.data = data


def cast_floating(values: Any, dtype: torch.dtype) -> Any:
    """`values` (a batch, a list of stage inputs) with every floating tensor in `dtype`; integer
    and boolean tensors (token ids, masks) and everything else as they are."""

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return pytree.tree_map(cast, values)


def as_computed(values: Any, precision: str) -> Any:
    """`values` (a batch) as stages computing in `precision` take them: floating tensors cast to it;
    in "fp32" as they are (a float64 input stays float64, as plait has always passed it)."""
    return values if precision == "fp32" else cast_floating(values, dtype_of(precision))
