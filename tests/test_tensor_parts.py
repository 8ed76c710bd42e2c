"""Tests for plait.tensor_parts: a parameter's part on each tp rank (fused q|k|v blocks included),
the parts joined back (uneven ones too), and a cut tensor's whole shape."""

from __future__ import annotations

import pytest
import torch

from plait.tensor_parts import (TpShard, as_held, local_part, part_rows, part_size, row_span, uneven_fits, whole_of,
                                whole_shape)


def test_local_part_takes_each_rank_its_slice_of_every_block() -> None:
    qkv = torch.arange(12.0)  # [q0 q1 | k0 k1 | v0 v1] with 2 features per piece
    assert local_part(qkv, 0, 3, 0, 2).tolist() == [0, 1, 4, 5, 8, 9]
    assert local_part(qkv, 0, 3, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    assert local_part(qkv, 0, 1, 1, 2).tolist() == list(range(6, 12))


@pytest.mark.parametrize("dim, blocks, tp", [(0, 1, 2), (1, 3, 2), (1, 1, 4), (0, 2, 4)])
def test_whole_of_joins_the_parts(dim: int, blocks: int, tp: int) -> None:
    t = torch.randn(8 * blocks, 24 * blocks)
    parts = [local_part(t, dim, blocks, r, tp) for r in range(tp)]
    assert all(p.shape[dim] == t.shape[dim] // tp for p in parts)
    assert torch.equal(whole_of(parts, dim, blocks), t)


def test_whole_shape_of_a_cut_tensor_and_a_plain_one() -> None:
    t = torch.zeros(3, 4)
    assert whole_shape(t) == (3, 4)
    t._plait_tp = TpShard((6, 4), 0, 1, 1, 2)  # type: ignore[attr-defined]
    assert whole_shape(t) == (6, 4)
    whole = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(t._plait_tp.part(whole), whole[3:])  # type: ignore[attr-defined]


def test_rows_that_do_not_divide_are_cut_in_parts_of_the_ceiling_the_last_holding_the_rest() -> None:
    """GPT2Config's 50257 words: 25129 + 25128 rows at tp=2, as Megatron's vocabulary padded to
    50258 would be held without its padding row."""
    assert [part_rows(50257, r, 2) for r in range(2)] == [(0, 25129), (25129, 50257)]
    assert [part_size(67, r, 4) for r in range(4)] == [17, 17, 17, 16]
    assert [part_size(64, r, 4) for r in range(4)] == [16] * 4
    assert uneven_fits(50257, 8) and not uneven_fits(9, 4)  # 9 at tp=4: 3, 3, 3 and none
    t = torch.randn(67, 5)
    parts = [local_part(t, 0, 1, r, 4) for r in range(4)]
    assert [p.shape[0] for p in parts] == [17, 17, 17, 16] and torch.equal(parts[3], t[51:])
    assert torch.equal(whole_of(parts, 0, 1), t)
    held = torch.zeros(16, 5)
    held._plait_tp = TpShard((67, 5), 0, 1, 3, 4)  # type: ignore[attr-defined]
    assert torch.equal(as_held(held, t), t[51:])  # a whole value loaded into the last, shorter part


@pytest.mark.parametrize("dim, blocks", [(None, 1), (1, 1), (1, 3), (0, 1), (0, 3)])
@pytest.mark.parametrize("rows", [(0, 2), (1, 3), (2, 2)])
def test_a_row_span_reads_whole_rows_that_give_the_rows_of_the_part(dim, blocks, rows):
    """Rows of a held tensor (a tp part, or a tensor not cut) read from the whole: the span's rows of the
    whole, kept as the span says, are the part's rows."""
    whole = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    held = whole if dim is None else local_part(whole, dim, blocks, 1, 2).clone()
    if dim is not None:
        held._plait_tp = TpShard((12, 6), dim, blocks, 1, 2)  # type: ignore[attr-defined]
    span = row_span(held, *rows)
    assert torch.equal(span.kept(whole[span.start:span.stop]), held[rows[0]:rows[1]])
    # only the part's rows are read where they are whole rows (one block along dim 0, or any cut along dim 1)
    assert span.stop - span.start == (12 if (dim, blocks) == (0, 3) else rows[1] - rows[0])
