"""The pieces a layer-by-layer recomputation checkpoints, and what a stage of them holds.

Captured layers are leaf modules (a transformer block is a dozen of them), so the runtime
checkpoints consecutive layers of one repeated block together: a layer named through its first
numeric component ('transformer.h.3' of 'transformer.h.3.attn.c_proj', a `ModuleList` entry)
belongs to that block's piece; a layer outside any such block ('lm_head', 'block7' of the
analytic GPT) is a piece of its own. A stage recomputed this way keeps, per held micro-batch, the
input of each piece it holds (the input of its first layer, then of each piece that starts
inside it) and, while one piece is recomputed, that piece's activations of one micro-batch:

    memory(layers j..i-1) = fixed[j:i] + max(piece_once[j:i]) + held x (entry[j] + piece_entry[j+1:i])

against `fixed[j:i] + once[j:i] + held x entry[j]` recomputed whole; the runtime takes, stage by
stage, whichever is less. `piece_once[l]` is the activations of l's whole piece, so a stage that
cuts a piece is priced as if it held all of it (never less than it needs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["piece_keys", "pieces", "piece_terms", "by_pieces", "range_max", "after_first"]


def piece_keys(names: Sequence[str]) -> list[str]:
    """Each layer's piece: its name through the first numeric component, else the name."""
    keys = []
    for name in names:
        parts = name.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        keys.append(".".join(parts[: cut + 1]) if cut is not None else name)
    return keys


def pieces(names: Sequence[str]) -> list[int]:
    """Each layer's piece index, counting runs of equal keys in layer order."""
    out: list[int] = []
    keys = piece_keys(names)
    for i, key in enumerate(keys):
        out.append(0 if i == 0 else out[-1] + (key != keys[i - 1]))
    return out


def piece_terms(names: Sequence[str], once: Sequence[float], entry: Sequence[float]
                ) -> tuple[list[float], list[float]]:
    """(piece_entry, piece_once) of each layer: the bytes entering it where it starts a piece
    (else 0), and the once-bytes of its whole piece."""
    index = pieces(names) if names else list(range(len(once)))
    totals: dict[int, float] = {}
    for p, value in zip(index, once):
        totals[p] = totals.get(p, 0.0) + value
    starts = [i == 0 or index[i] != index[i - 1] for i in range(len(index))]
    return ([e if start else 0.0 for e, start in zip(entry, starts)], [totals[p] for p in index])


def range_max(values: Sequence[float]) -> npt.NDArray[np.float64]:
    """[start, end]: max(values[start:end]) for start < end (0 elsewhere), an (n + 1) x (n + 1) table."""
    n = len(values)
    table = np.zeros((n + 1, n + 1))
    array = np.asarray(values, dtype=np.float64)
    for start in range(n):
        table[start, start + 1:] = np.maximum.accumulate(array[start:])
    return table


def by_pieces(fixed: Sequence[float], per_held: Sequence[float], entry: Sequence[float],
              piece_once: Sequence[float], piece_entry: Sequence[float], start: int, end: int, held: float) -> float:
    """The memory above of layers start..end-1 holding `held` micro-batches (`entry` () = zeros)."""
    first = entry[start] if len(entry) else 0.0
    return (sum(fixed[start:end]) + max(piece_once[start:end])
            + held * (sum(per_held[start:end]) + first + sum(piece_entry[start + 1:end])))


def after_first(piece_entry: Sequence[float]) -> npt.NDArray[np.float64]:
    """[start, end]: sum(piece_entry[start + 1:end]), the entries held after a range's first layer,
    an (n + 1) x (n + 1) table (meaningful for start < end)."""
    n = len(piece_entry)
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(piece_entry, dtype=np.float64))))
    return np.asarray(prefix[None, :] - prefix[np.minimum(np.arange(n + 1) + 1, n)][:, None], dtype=np.float64)

