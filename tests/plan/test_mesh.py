"""The mesh: every rank's place on the named axes, each axis's groups, and the check of its factors."""

import itertools

import pytest

from plait.errors import ConfigError
from plait.plan import Mesh, Plan
from plait.plan.mesh import Coordinates
from plait.plan.setting import Setting

UNIFORM = [Mesh(world_size=pp * dp * tp, pp=pp, dp=dp, tp=tp, num_virtual_stages=v)
           for pp, dp, tp, v in itertools.product((1, 2, 3), (1, 2, 3), (1, 2, 4), (1, 2))]
STAGE_TP = [Mesh(world_size=sum(w) * dp, pp=len(w), dp=dp, tp=max(w), stage_tp=w)
            for w in ((2, 1), (1, 2), (1, 3), (2, 1, 4), (3, 3, 1)) for dp in (1, 2, 3)]
STAGE_DP = [Mesh(world_size=sum(w), pp=len(w), stage_dp=w) for w in ((2, 1), (1, 2), (3, 2), (1, 4, 2), (1, 1))]
LAYOUTS = UNIFORM + STAGE_TP + STAGE_DP


def places(mesh: Mesh) -> list[tuple[int, int, int]]:
    """Every (position, replica, tp rank) of the mesh."""
    return [(p, r, t) for p in range(mesh.pp) for r in range(mesh.dp_of(p)) for t in range(mesh.tp_of(p))]


@pytest.mark.parametrize("mesh", LAYOUTS, ids=str)
def test_coordinates_round_trip_on_every_rank(mesh: Mesh) -> None:
    found = places(mesh)
    assert sorted(mesh.rank_of(*place) for place in found) == list(range(mesh.world_size))  # one rank each
    for rank in range(mesh.world_size):
        c = mesh.coordinates(rank)
        assert mesh.rank_of(c.position, c.replica, c.tp_rank) == rank
        assert mesh.position_of(rank) == (c.position, c.replica) and mesh.tp_rank_of(rank) == c.tp_rank
        assert mesh.stages_of(rank) == tuple(range(c.position, mesh.num_chunks, mesh.pp))
        for s in mesh.stages_of(rank):  # every chunk of an interleaved rank is on it
            assert mesh.rank_of(s, c.replica, c.tp_rank) == rank and mesh.position_of_stage(s) == c.position


@pytest.mark.parametrize("mesh", UNIFORM, ids=str)
def test_the_uniform_layout_is_tp_innermost_then_position_then_replica(mesh: Mesh) -> None:
    for s, r, t in itertools.product(range(mesh.num_chunks), range(mesh.dp), range(mesh.tp)):
        assert mesh.rank_of(s, r, t) == (r * mesh.pp + s % mesh.pp) * mesh.tp + t


def test_the_pictures_of_the_docstring() -> None:
    mesh = Mesh(world_size=8, pp=2, dp=2, tp=2)
    assert [[mesh.stage_ranks(p, r) for p in range(2)] for r in range(2)] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert mesh.coordinates(5) == Coordinates(position=0, replica=1, tp_rank=1)
    assert (mesh.tp_ranks(2), mesh.dp_ranks(1), mesh.lane_ranks(1)) == ((2, 3), (1, 5), (1, 3))
    widths = Mesh(world_size=6, pp=2, dp=2, tp=2, stage_tp=(2, 1))
    assert [[widths.stage_ranks(p, r) for p in range(2)] for r in range(2)] == [[(0, 1), (2,)], [(3, 4), (5,)]]
    replicas = Mesh(world_size=3, pp=2, stage_dp=(2, 1))
    assert [replicas.replica_ranks(p) for p in range(2)] == [(0, 1), (2,)]
    assert [replicas.coordinates(r) for r in range(3)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0)]


def test_interleaved_ranks_hold_every_pp_th_stage() -> None:
    mesh = Mesh(world_size=4, pp=2, dp=2, num_virtual_stages=2)
    assert [mesh.stages_of(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert mesh.lane_ranks(3) == (2, 3, 2, 3) and mesh.rank_of(3, 1) == 3


def test_a_narrower_stage_serves_every_lane_of_the_wider() -> None:
    widths = Mesh(world_size=6, pp=2, dp=2, tp=2, stage_tp=(2, 1))
    assert [widths.lane_ranks(r) for r in range(6)] == [(0, 2), (1, 2), (0, 2), (3, 5), (4, 5), (3, 5)]
    replicas = Mesh(world_size=3, pp=2, stage_dp=(2, 1))
    assert [replicas.lane_ranks(r) for r in range(3)] == [(0, 2), (1, 2), (0, 2)]


# -- groups --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, tp, dp, pp", [
    (Mesh(world_size=8, pp=2, dp=2, tp=2),
     [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)]),
    (Mesh(world_size=6, pp=2, dp=3), [], [(0, 2, 4), (1, 3, 5)], [(0, 1), (2, 3), (4, 5)]),
    (Mesh(world_size=4, pp=1, tp=4), [(0, 1, 2, 3)], [], [(0,), (1,), (2,), (3,)]),
    (Mesh(world_size=6, pp=2, dp=2, tp=2, stage_tp=(2, 1)),
     [(0, 1), (3, 4)], [(0, 3), (1, 4), (2, 5)], [(0, 2), (1, 2), (3, 5), (4, 5)]),
    (Mesh(world_size=3, pp=2, stage_dp=(2, 1)), [], [(0, 1)], [(0, 2), (1, 2)]),
    (Mesh(world_size=5, pp=2, stage_dp=(2, 3)), [], [(0, 1), (2, 3, 4)], [(0, 2), (1, 3), (1, 4)]),
])
def test_each_axis_lists_its_groups_in_one_order(mesh: Mesh, tp: list, dp: list, pp: list) -> None:
    assert (mesh.tp_groups(), mesh.dp_groups(), mesh.pp_groups()) == (tp, dp, pp)


@pytest.mark.parametrize("mesh", LAYOUTS, ids=str)
def test_tp_and_dp_groups_partition_the_ranks(mesh: Mesh) -> None:
    for groups, mine in ((mesh.tp_groups(), mesh.tp_ranks), (mesh.dp_groups(), mesh.dp_ranks)):
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)) and all(len(g) > 1 for g in groups)
        for rank in range(mesh.world_size):  # a rank's group, or itself alone where its stage has one rank
            assert rank in mine(rank) and (mine(rank) in groups) == (len(mine(rank)) > 1)
    for rank in range(mesh.world_size):
        position, replica, t = mesh.coordinates(rank)
        assert mesh.tp_ranks(rank) == mesh.stage_ranks(position, replica)
        assert [mesh.coordinates(r) for r in mesh.dp_ranks(rank)] == [
            (position, r, t) for r in range(mesh.dp_of(position))]


@pytest.mark.parametrize("mesh", LAYOUTS, ids=str)
def test_pp_groups_are_the_lanes(mesh: Mesh) -> None:
    lanes = mesh.pp_groups()
    assert sorted({r for lane in lanes for r in lane}) == list(range(mesh.world_size))
    assert all(len(lane) == mesh.pp and [mesh.coordinates(r).position for r in lane] == list(range(mesh.pp))
               for lane in lanes)
    assert {mesh.lane_ranks(r)[:mesh.pp] for r in range(mesh.world_size)} == set(lanes)
    if mesh in UNIFORM:  # every stage as wide: the lanes partition the ranks
        assert sum(len(lane) for lane in lanes) == mesh.world_size


# -- the check, once -----------------------------------------------------------------------------

def test_a_wrong_product_prints_every_factor_and_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        Mesh(world_size=8, pp=2, dp=3, tp=2)
    assert str(e.value) == ("pp=2 x dp=3 x tp=2 = 12 ranks, but world_size=8; pp x dp x tp must equal the world "
                            "size: use dp=2 (pp=2 x tp=2 x dp=2 = 8)")
    with pytest.raises(ConfigError, match=r"pp=2 x dp=1 x tp=2 = 4 ranks, but world_size=6; .*world_size=6 is "
                                          r"not a multiple of pp x tp = 4: change pp or tp"):
        Mesh(world_size=6, pp=2, tp=2)


@pytest.mark.parametrize("fields, message", [
    ({"world_size": 0, "pp": 1}, "world_size=0; it must be a positive integer"),
    ({"world_size": 2, "pp": 2, "tp": True}, "tp=True; it must be a positive integer"),
    ({"world_size": 2, "pp": 2, "dp": 1.0}, "dp=1.0; it must be a positive integer"),
    ({"world_size": 3, "pp": 2, "stage_tp": (2, 1), "stage_dp": (2, 1)}, "stages differ in one width at a time"),
    ({"world_size": 3, "pp": 3, "tp": 2, "stage_tp": (2, 1)}, r"stage_tp=\[2, 1\] for 3 stages"),
    ({"world_size": 4, "pp": 2, "tp": 2, "stage_tp": (2, 1)}, r"stage_tp=\[2, 1\], 3 ranks in all, on world_size=4"),
    ({"world_size": 3, "pp": 2, "tp": 1, "stage_tp": (2, 1)}, r"tp=1 and stage_tp=\[2, 1\]; tp is the widest"),
    ({"world_size": 3, "pp": 2, "tp": 2, "num_virtual_stages": 2, "stage_tp": (2, 1)}, "no interleaving"),
    ({"world_size": 3, "pp": 2, "tp": 2, "stage_dp": (2, 1)}, r"stage_dp=\[2, 1\] with dp=1, tp=2"),
    ({"world_size": 3, "pp": 2, "stage_dp": (3, 0)}, r"stage_dp=\[3, 0\] for 2 stages; give one positive dp"),
])
def test_bad_degrees_and_widths_are_named(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Mesh(**fields)


def test_a_place_off_the_mesh_is_named() -> None:
    mesh = Mesh(world_size=4, pp=2, dp=2)
    with pytest.raises(ConfigError, match=r"rank 4 is not in the plan's 4 ranks \(pp=2 x dp=2 x tp=1\)"):
        mesh.coordinates(4)
    with pytest.raises(ConfigError, match="stage 0, replica 2, tp rank 0 is not a place on the mesh"):
        mesh.rank_of(0, 2)
    with pytest.raises(ConfigError, match="stage 2, replica 0, tp rank 0"):
        mesh.rank_of(2)


def test_the_mesh_is_frozen_and_compares_by_its_axes() -> None:
    mesh = Mesh(world_size=4, pp=2, dp=2)
    with pytest.raises(AttributeError):
        mesh.dp = 4  # type: ignore[misc]
    assert mesh == Mesh(world_size=4, pp=2, dp=2) and hash(mesh) == hash(Mesh(world_size=4, pp=2, dp=2))
    assert str(Mesh(world_size=6, pp=2, dp=2, tp=2, stage_tp=(2, 1))) == "pp=2 x dp=2 x tp=[2, 1] (per stage)"


# -- the plan and the setting answer from their mesh ---------------------------------------------

def test_a_plan_asks_its_mesh() -> None:
    plan = Plan(layer_names=tuple("abcd"), layers_per_stage=(1, 1, 1, 1), num_microbatches=4, schedule="interleaved",
                world_size=8, capture_method="torch.export", dp=2, tp=2, num_virtual_stages=2)
    assert plan.mesh == Mesh(world_size=8, pp=2, dp=2, tp=2, num_virtual_stages=2)
    assert plan.stage_to_rank == (0, 2, 0, 2) and plan.stages_of(6) == (1, 3) and plan.rank_of(3, 1, 1) == 7
    assert Plan.from_json(plan.to_json()) == plan and "mesh" not in plan.to_json()
    widths = Plan(layer_names=tuple("ab"), layers_per_stage=(1, 1), num_microbatches=1, schedule="1f1b",
                  world_size=3, capture_method="torch.export", stage_tp=(2, 1))
    assert widths.tp == 2 and widths.mesh.tp_groups() == [(0, 1)]


def test_regression_a_plan_of_more_ranks_than_its_degrees_is_refused() -> None:
    """A plan file of 2 stages x dp=3 on world_size=8 loaded: the plan checked only that tp divided the
    world size, so ranks 6 and 7 fell on a fourth replica that did not exist (position_of(6) was
    (0, 3)) and would have waited for peers that never came. The mesh checks the product once."""
    with pytest.raises(ConfigError, match=r"pp=2 x dp=3 x tp=1 = 6 ranks, but world_size=8; .*: use dp=4"):
        Plan(layer_names=("a", "b"), layers_per_stage=(1, 1), num_microbatches=2, schedule="1f1b", world_size=8,
             capture_method="torch.export", dp=3)


def test_regression_the_search_prices_the_ranks_the_runtime_uses() -> None:
    """Setting.rank_of kept its own copy of the layout (replica * pp + stage % pp), beside the plan's:
    the cost model priced a stage's replicas on the ranks its copy named. Both now ask a mesh."""
    for pp, dp, v in itertools.product((1, 2, 4), (1, 2, 3), (1, 2)):
        setting = Setting(pp=pp, dp=dp, num_microbatches=4, schedule="interleaved" if v > 1 else "1f1b",
                          num_virtual_stages=v)
        plan = Plan(layer_names=tuple(str(i) for i in range(pp * v)), layers_per_stage=(1,) * (pp * v),
                    num_microbatches=4, schedule=setting.schedule, world_size=pp * dp, capture_method="torch.export",
                    dp=dp, num_virtual_stages=v)
        assert setting.mesh == plan.mesh
        assert all(setting.rank_of(s, r) == plan.rank_of(s, r) for s in range(pp * v) for r in range(dp))
