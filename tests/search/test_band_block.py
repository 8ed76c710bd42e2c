"""A stage's block of candidate ranges in the banded partition: each column's first minimum against numpy's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plait.search.band_block import first_minimum


@pytest.mark.parametrize("rows, width", [(1, 7), (2, 300), (3, 5), (5, 10), (5, 300), (40, 130), (200, 40)])
def test_the_first_minimum_is_numpys_argmin_with_ties_and_infinities(rows: int, width: int) -> None:
    rng = np.random.default_rng(rows * width)
    value = rng.integers(0, 3, size=(rows, width)).astype(np.float64)  # many ties
    value[rng.random((rows, width)) < 0.3] = math.inf
    value[:, 0] = math.inf  # a column with no range at all
    row, least = first_minimum(value)
    assert row.tolist() == value.argmin(axis=0).tolist()
    assert least.tolist() == value.min(axis=0).tolist()
