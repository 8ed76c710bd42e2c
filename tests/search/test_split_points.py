"""Tests for plait.search.split_points: module names to layers per stage, and errors naming the point and the fix."""

from __future__ import annotations

import pytest

from plait.errors import PartitionError
from plait.search.split_points import cut_at, first_layer_in

# tests/models.py's TinyGPT as captured: 16 layers
GPT = ("wte", "wpe",
       "h.0.ln_1", "h.0.c_attn", "h.0.c_proj", "h.0.ln_2", "h.0.fc", "h.0.proj",
       "h.1.ln_1", "h.1.c_attn", "h.1.c_proj", "h.1.ln_2", "h.1.fc", "h.1.proj",
       "ln_f", "lm_head")


@pytest.mark.parametrize("points, counts", [
    ([], (16,)),
    (["h.1"], (8, 8)),
    (("h.0", "ln_f"), (2, 12, 2)),
    (["h.0", "h.1", "lm_head"], (2, 6, 7, 1)),
    (["h.0.fc"], (6, 10)),  # a leaf module itself
    (["wpe"], (1, 15)),
    (["h"], (2, 14)),  # the ModuleList: its first layer
])
def test_each_point_starts_a_stage_at_its_first_layer(points, counts) -> None:
    assert cut_at(points, GPT) == counts
    assert sum(counts) == len(GPT)


def test_a_point_is_a_whole_name_component_not_a_text_prefix() -> None:
    names = ("embed", "h.1.fc", "h.10.fc", "h.11.fc", "head")
    assert first_layer_in("h.1", names) == 1
    assert first_layer_in("h.10", names) == 2
    assert first_layer_in("h.1.f", names) is None  # "h.1.fc" is not inside "h.1.f"
    assert cut_at(["h.10"], names) == (2, 3)


def test_repeated_calls_match_the_first_and_a_call_may_be_named() -> None:
    # ALBERT-like: one shared layer called three times ("#k": the k-th further call)
    names = ("embed", "shared", "shared#1", "shared#2", "head")
    assert first_layer_in("shared", names) == 1
    assert first_layer_in("shared#2", names) == 3
    assert cut_at(["shared#1"], names) == (2, 3)
    assert cut_at(["shared", "shared#2"], names) == (1, 2, 2)


def test_a_point_matching_no_layer_lists_the_nearest_names_and_how_to_list_them() -> None:
    with pytest.raises(PartitionError) as info:
        cut_at(["h.0", "h.2"], GPT)
    assert str(info.value) == (
        "split point 'h.2' (split_points=['h.0', 'h.2']) matches no captured layer of the model "
        "(16 layers, from wte to lm_head); the nearest module names are ['h.1', 'h.0', "
        "'h.1.ln_2', 'h.0.ln_2', 'h']. To see them, "
        "list the captured layers with plait.capture.trace.capture_batch(net, x).layers.layer_names "
        "(or model.plan.layer_names of a built model) and name a module of net.named_modules() that "
        "runs at least one of them")


def test_a_point_far_from_every_name_says_so() -> None:
    with pytest.raises(PartitionError, match=r"'model\.layers\.6' .* no module name is close\. To see them"):
        cut_at(["model.layers.6"], GPT)


def test_points_out_of_order_are_listed_in_the_models_order() -> None:
    with pytest.raises(PartitionError) as info:
        cut_at(["ln_f", "h.1", "h.0"], GPT)
    assert str(info.value) == (
        "split point 'h.1' starts at layer 8 (h.1.ln_1), before 'ln_f' (layer 14, ln_f) listed ahead "
        "of it; list the points in the model's order: split_points=['h.0', 'h.1', 'ln_f']")


def test_two_points_at_one_layer_would_leave_an_empty_stage() -> None:
    with pytest.raises(PartitionError) as info:
        cut_at(["h.1", "h.1.ln_1"], GPT)
    assert str(info.value) == (
        "split points 'h.1' and 'h.1.ln_1' both start at layer 8 (h.1.ln_1): the stage between them "
        "would be empty; drop one of them from split_points=['h.1', 'h.1.ln_1']")


def test_a_point_at_the_first_layer_would_leave_the_first_stage_empty() -> None:
    with pytest.raises(PartitionError) as info:
        cut_at(["wte", "h.1"], GPT)
    assert str(info.value) == (
        "split point 'wte' starts at layer 0 (wte), the model's first layer: the stage before it "
        "would be empty; drop it from split_points=['wte', 'h.1']")


def test_a_cut_inside_an_uncuttable_region_is_reported_by_check_partition() -> None:
    names = ("embed", "norm", "block", "norm#1", "head")  # norm has buffers and is called twice: 1..3 stay whole
    assert cut_at(["head"], names, uncuttable=[(1, 3)]) == (4, 1)
    with pytest.raises(PartitionError) as info:
        cut_at(["block"], names, uncuttable=[(1, 3)])
    assert str(info.value) == (
        "split_points=['block'] (the cut layers_per_stage=[2, 3]): layers_per_stage=[2, 3] cuts after "
        "layer 1 (norm), inside an uncuttable region: layers 1..3 (norm, block, norm#1) reuse a module "
        "and must stay on one stage. Move the cut before layer 1 or after layer 3")
