"""Tests for plait.search.tp_strategies: the resharding table exactly, the block's strategies and costs,
the collectives a choice implies, and shapes and meshes that cannot be."""

from __future__ import annotations

import pytest

from plait.cost.network import Link, all_gather, all_reduce, reduce_scatter
from plait.errors import ConfigError
from plait.search.tp_strategies import (
    MEGATRON_LAYOUT,
    BlockShape,
    TpMesh,
    block_strategies,
    collectives,
    reshard,
    transformer_block,
)

LINK = Link(latency_s=1e-5, bandwidth=1e9)
T = 8e6  # bytes of the whole tensor


@pytest.mark.parametrize("src, dst, kind, seconds", [
    ("R", "R", None, 0.0),
    ("S", "S", None, 0.0),
    ("R", "S", None, 0.0),  # a local slice
    ("S", "R", "all-gather", 3 * 1e-5 + 3 * T / (4 * 1e9)),  # (p-1) alpha + (p-1) T/(pB)
    ("P", "R", "all-reduce", 6 * 1e-5 + 6 * T / (4 * 1e9)),  # 2(p-1) alpha + 2(p-1) T/(pB)
    ("P", "S", "reduce-scatter", 3 * 1e-5 + 3 * T / (4 * 1e9)),  # (p-1) alpha + (p-1) T/(pB)
])
def test_resharding_follows_the_ring_formulas(src, dst, kind, seconds) -> None:
    found = reshard(src, dst, T, 4, LINK)
    assert found[0] == kind and found[1] == pytest.approx(seconds, rel=1e-12)


def test_resharding_agrees_with_the_network_module_and_refuses_a_partial_target() -> None:
    assert reshard("S", "R", T, 8, LINK)[1] == all_gather(T / 8, 8, LINK)
    assert reshard("P", "R", T, 8, LINK)[1] == all_reduce(T, 8, LINK)
    assert reshard("P", "S", T, 8, LINK)[1] == reduce_scatter(T, 8, LINK)
    assert reshard("P", "R", T, 1, LINK) == ("all-reduce", 0.0)  # one device: nothing moves
    with pytest.raises(ConfigError, match=r"no strategy reads a partial sum \(R -> P\)"):
        reshard("R", "P", T, 4, LINK)


def test_the_block_offers_what_divides() -> None:
    names = {op: [s.name for s in ways] for op, ways in block_strategies(BlockShape(1024, 16, 512), 4).items()}
    assert names["qkv"] == names["out_proj"] == names["fc"] == names["proj"] == ["replicate", "colwise", "rowwise"]
    assert names["attention"] == ["replicate", "heads"] and names["gelu"] == ["replicate", "sharded"]
    assert names["ln1"] == names["add2"] == names["input"] == ["replicate"]
    odd = block_strategies(BlockShape(hidden=960, heads=12, tokens=512, ffn_hidden=3004), 8)
    assert [s.name for s in odd["attention"]] == ["replicate"]  # 12 heads on 8 devices
    assert [s.name for s in odd["fc"]] == ["replicate", "rowwise"]  # 3004 outputs do not split in 8; 960 inputs do
    assert [s.name for s in odd["proj"]] == ["replicate", "colwise"]  # and the other way round
    assert [s.name for s in odd["gelu"]] == ["replicate"]


def test_a_blocks_costs_are_its_flops_and_weights_over_tp() -> None:
    shape, mesh = BlockShape(hidden=1024, heads=16, tokens=2048, seq_len=1024), TpMesh(4, LINK, 1e12)
    forward = transformer_block(shape, mesh, training=False)
    fc = {s.name: s for s in forward.operator("fc").strategies}
    assert fc["replicate"].compute_s == pytest.approx(2 * 2048 * 1024 * 4096 / 1e12)
    assert fc["colwise"].compute_s == pytest.approx(fc["replicate"].compute_s / 4)
    assert fc["rowwise"].memory_bytes == fc["colwise"].memory_bytes == 1024 * 4096 * 2 / 4
    attention = {s.name: s for s in forward.operator("attention").strategies}
    assert attention["replicate"].compute_s == pytest.approx(4 * 2048 * 1024 * 1024 / 1e12)
    training = transformer_block(shape, mesh)
    assert training.operator("fc").strategies[0].compute_s == pytest.approx(3 * fc["replicate"].compute_s)
    edge = {(e.producer, e.consumer): e for e in forward.edges}[("out_proj", "add1")]
    act = 2048 * 1024 * 2  # tokens x hidden x bf16
    assert edge.resharding_s == ((0.0,), (all_gather(act / 4, 4, LINK),), (all_reduce(act, 4, LINK),))


def test_training_prices_the_gradients_way_back() -> None:
    shape, mesh = BlockShape(hidden=1024, heads=16, tokens=2048), TpMesh(4, LINK, 1e12)
    act = 2048 * 1024 * 2
    edges = {(e.producer, e.consumer): e for e in transformer_block(shape, mesh).edges}
    ln2_fc = edges[("ln2", "fc")].resharding_s[0]  # ln2 gives R; fc replicate / colwise / rowwise
    assert ln2_fc == (0.0, all_reduce(act, 4, LINK), all_gather(act / 4, 4, LINK))
    found = collectives(shape, mesh, {"ln2": "replicate", "fc": "rowwise", "gelu": "sharded"})
    assert [(c.producer, c.consumer, c.kind, c.direction) for c in found] == [
        ("ln2", "fc", "all-gather", "backward"), ("fc", "gelu", "reduce-scatter", "forward"),
        ("fc", "gelu", "all-gather", "backward"), ("gelu", "proj", "all-gather", "forward")]


def test_megatrons_layout_puts_four_all_reduces_on_a_block() -> None:
    shape, mesh = BlockShape(hidden=1024, heads=16, tokens=2048), TpMesh(2, LINK, 1e12)
    found = collectives(shape, mesh, MEGATRON_LAYOUT)
    assert [c.kind for c in found] == ["all-reduce"] * 4
    assert sum(c.seconds for c in found) == pytest.approx(4 * all_reduce(2048 * 1024 * 2, 2, LINK))
    assert collectives(shape, mesh, MEGATRON_LAYOUT, training=False)[0].direction == "forward"
    with pytest.raises(ConfigError, match=r"operator 'attention' has no strategy 'rows' at tp=2"):
        collectives(shape, mesh, {"attention": "rows"})
    with pytest.raises(ConfigError, match=r"operators the block does not have: \['mlp'\]"):
        collectives(shape, mesh, {"mlp": "colwise"})


@pytest.mark.parametrize("build, message", [
    (lambda: BlockShape(hidden=1000, heads=16, tokens=8), "hidden=1000 is not a multiple of heads=16"),
    (lambda: BlockShape(hidden=1024, heads=0, tokens=8), "BlockShape.heads must be a positive integer, got 0"),
    (lambda: BlockShape(hidden=1024, heads=16, tokens=8, seq_len=2.5),  # type: ignore[arg-type]
     "seq_len must be a positive integer"),
    (lambda: TpMesh(0, LINK, 1e12), "TpMesh.tp must be a positive integer, got 0"),
    (lambda: TpMesh(2, LINK, 0.0), "flops_per_s must be a finite number > 0, got 0.0"),
])
def test_bad_shapes_and_meshes_are_refused_with_the_value(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()
