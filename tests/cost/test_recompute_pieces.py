"""Tests for plait.cost.recompute_pieces: a repeated block's layers form one piece, what a stage of
pieces keeps, and range maxima."""

from __future__ import annotations

import numpy as np

from plait.cost.recompute_pieces import after_first, by_pieces, piece_keys, piece_terms, pieces, range_max

GPT2 = ["transformer.wte", "transformer.wpe", "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn",
        "transformer.h.0.mlp.c_proj", "transformer.h.1.ln_1", "transformer.h.1.mlp.c_proj", "transformer.ln_f",
        "lm_head"]


def test_a_repeated_block_is_one_piece_and_the_rest_stand_alone() -> None:
    assert piece_keys(GPT2) == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.0",
                                "transformer.h.0", "transformer.h.1", "transformer.h.1", "transformer.ln_f", "lm_head"]
    assert pieces(GPT2) == [0, 1, 2, 2, 2, 3, 3, 4, 5]
    assert pieces(["0", "1", "2"]) == [0, 1, 2]  # nn.Sequential: each entry its own
    assert pieces(["embedding", "block0", "block1", "head"]) == [0, 1, 2, 3]  # the analytic GPT's blocks


def test_a_piece_keeps_its_first_layer_s_input_and_recomputes_its_whole_activations() -> None:
    names = ["h.0.a", "h.0.b", "h.1.a", "h.1.b", "head"]
    piece_entry, piece_once = piece_terms(names, [1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0])
    assert piece_entry == [10.0, 0.0, 30.0, 0.0, 50.0]
    assert piece_once == [3.0, 3.0, 7.0, 7.0, 5.0]


def test_range_max_is_the_maximum_of_each_range() -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0]
    table = range_max(values)
    for start in range(len(values)):
        for end in range(start + 1, len(values) + 1):
            assert table[start, end] == max(values[start:end])
    assert table.shape == (6, 6) and np.all(np.tril(table) == 0)


def test_a_range_by_pieces_holds_its_first_input_and_each_later_piece_s() -> None:
    piece_entry = [10.0, 0.0, 30.0, 0.0, 50.0]
    table = after_first(piece_entry)
    assert table[0, 5] == 80.0 and table[1, 3] == 30.0 and table[2, 3] == 0.0
    fixed, per_held, entry, piece_once = [1.0] * 5, [0.0] * 5, [10.0, 20.0, 30.0, 40.0, 50.0], [3.0, 3.0, 7.0, 7.0, 5.0]
    # layers 1..3: fixed 3, the largest piece 7, and per held micro-batch 20 (layer 1's input) + 30
    assert by_pieces(fixed, per_held, entry, piece_once, piece_entry, 1, 4, 2.0) == 3 + 7 + 2 * (20 + 30)

