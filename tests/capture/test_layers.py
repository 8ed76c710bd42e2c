"""Layer grouping: functional code joins its neighbour; a reused module is cut between its calls
unless it holds buffers, which make an uncuttable region."""

from plait.capture.layers import assign_layers


def test_functional_ops_join_the_layer_before_them():
    a = assign_layers([None, "emb", None, "qkv", None, None, "proj", None], buffered=set())
    assert a.layer_names == ("emb", "qkv", "proj")
    assert a.op_layer == (0, 0, 0, 1, 1, 1, 2, 2)
    assert a.uncuttable == ()


def test_reused_module_with_parameters_only_is_cuttable_between_its_calls():
    # a -> b -> a -> c: the cycle a -> b -> a of the layer-dependency graph (nkflow §3.3.1) is
    # layer reuse: each call its own layer, the parameters tied over the stages that call it
    a = assign_layers(["a", "b", "a", "a", "c"], buffered=set())
    assert a.layer_names == ("a", "b", "a#1", "c")
    assert a.op_layer == (0, 1, 2, 2, 3)  # two ops of one call are one layer
    assert a.uncuttable == ()
    assert all(a.valid_cut(k) for k in range(3))


def test_reused_module_with_buffers_is_one_uncuttable_region():
    a = assign_layers(["a", "b", "a", "c"], buffered={"a"})
    assert a.layer_names == ("a", "b", "a#1", "c")
    assert a.uncuttable == ((0, 2),)
    assert not a.valid_cut(0) and not a.valid_cut(1) and a.valid_cut(2)
    assert a.region_of(1) == (0, 2)


def test_reused_stateless_module_stays_cuttable():
    a = assign_layers(["l1", "relu", "l2", "relu", "l3"], buffered=set())
    assert a.layer_names == ("l1", "relu", "l2", "relu#1", "l3")
    assert a.uncuttable == ()


def test_overlapping_regions_merge():
    a = assign_layers(["a", "b", "a", "c", "b", "d"], buffered={"a", "b", "c", "d"})
    assert a.uncuttable == ((0, 4),)


def test_graph_without_modules_is_one_layer():
    a = assign_layers([None, None], buffered=set())
    assert a.layer_names == ("<functional>",) and a.op_layer == (0, 0)
