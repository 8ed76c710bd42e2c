"""Layer grouping: functional code joins its neighbour; reused stateful modules make uncuttable regions."""

from plait.capture.layers import assign_layers


def test_functional_ops_join_the_layer_before_them():
    a = assign_layers([None, "emb", None, "qkv", None, None, "proj", None], stateful={"emb", "qkv", "proj"})
    assert a.layer_names == ("emb", "qkv", "proj")
    assert a.op_layer == (0, 0, 0, 1, 1, 1, 2, 2)
    assert a.uncuttable == ()


def test_reused_stateful_module_is_one_uncuttable_region():
    # a -> b -> a -> c: the layer-dependency graph has the cycle a -> b -> a (nkflow §3.3.1)
    a = assign_layers(["a", "b", "a", "c"], stateful={"a", "b", "c"})
    assert a.layer_names == ("a", "b", "a#1", "c")
    assert a.uncuttable == ((0, 2),)
    assert not a.valid_cut(0) and not a.valid_cut(1) and a.valid_cut(2)
    assert a.region_of(1) == (0, 2)


def test_reused_stateless_module_stays_cuttable():
    a = assign_layers(["l1", "relu", "l2", "relu", "l3"], stateful={"l1", "l2", "l3"})
    assert a.layer_names == ("l1", "relu", "l2", "relu#1", "l3")
    assert a.uncuttable == ()


def test_overlapping_regions_merge():
    a = assign_layers(["a", "b", "a", "c", "b", "d"], stateful={"a", "b", "c", "d"})
    assert a.uncuttable == ((0, 4),)


def test_graph_without_modules_is_one_layer():
    a = assign_layers([None, None], stateful=set())
    assert a.layer_names == ("<functional>",) and a.op_layer == (0, 0)
