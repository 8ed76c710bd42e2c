"""The `Mesh`: the ranks' named axes (pp, dp, tp, per-stage widths), and where every rank sits on them."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple

from plait.errors import ConfigError

__all__ = ["Mesh", "Coordinates"]


class Coordinates(NamedTuple):
    """Where one rank sits: its pipeline position (its first stage), its replica, its tp rank."""

    position: int
    replica: int
    tp_rank: int


@dataclass(frozen=True)
class Mesh:
    """The named axes of `world_size` ranks; every question of place is answered here, and only here.

    Rank order, innermost first: tp (collectives in every layer: consecutive ranks, one node), then
    the pipeline position (activations every micro-batch: neighbours share a node whenever a node
    holds a whole pipeline), then dp (an all-reduce once a step: replicas are pp x tp ranks apart)::

        rank = (replica * pp + position) * tp + tp_rank        position = stage % pp

        pp = 2, dp = 2, tp = 2 (8 ranks)     position 0    position 1
                               replica 0:    ranks 0 1  |  ranks 2 3      a tp group: ranks 2 3
                               replica 1:    ranks 4 5  |  ranks 6 7      a dp group: ranks 1 5
                                                                          a pp group (lane): 1 3

    With v chunks per rank (interleaved), the rank at position p holds stages p, p + pp, ... Stages
    of different widths (`stage_tp`) take the ranks in stage order, a pipeline replica after another;
    stages of different replica counts (`stage_dp`, tp = 1) likewise, a stage's replicas in place
    of its tp ranks::

        stage_tp = (2, 1), dp = 2:   replica 0: ranks 0 1 | 2     replica 1: ranks 3 4 | 5
        stage_dp = (2, 1):           stage 0: replicas on ranks 0 1 | stage 1: rank 2

    A rank of a narrower stage serves every lane of the wider ones (`lane_ranks`): at stage_tp =
    (2, 1) rank 2 is the next stage of both rank 0 and rank 1.

    A new axis (cp, ep) is a field here (checked positive, one factor of the product), its place in
    the rank order (cp between tp and the position, as torchtitan orders them: its ring exchanges
    keys and values every layer, less than tp's collectives, more than pp's activations), its
    coordinate in `Coordinates` and its groups (`cp_groups`, listed like `tp_groups`); ep usually
    borrows the ranks of dp (x cp), its groups sub-blocks of `dp_groups`. Nothing else changes but
    the code of that parallelism.
    """

    world_size: int
    pp: int  # ranks of one pipeline replica: the pipeline positions
    dp: int = 1  # replicas of the whole pipeline
    tp: int = 1  # tensor-parallel ranks per stage (with stage_tp: the widest stage's)
    num_virtual_stages: int = 1  # stages (model chunks) per rank: interleaved
    stage_tp: tuple[int, ...] = ()  # per stage, when stages differ in tp (one chunk per rank)
    stage_dp: tuple[int, ...] = ()  # per stage, when stages differ in replicas (dp = tp = 1)
    # derived once: the first rank of each position within a replica's ranks, and how many those are
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _span: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        degrees = {"world_size": self.world_size, "pp": self.pp, "dp": self.dp, "tp": self.tp,
                   "num_virtual_stages": self.num_virtual_stages}
        for name, value in degrees.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        if self.stage_tp and self.stage_dp:
            raise ConfigError(f"stage_tp={list(self.stage_tp)} and stage_dp={list(self.stage_dp)}; "
                              "stages differ in one width at a time: give one of them")
        if self.stage_tp:
            self._check_stage_tp()
        elif self.stage_dp:
            self._check_stage_dp()
        elif self.pp * self.dp * self.tp != self.world_size:
            raise ConfigError(self._product_error())
        widths = self.stage_dp or self.stage_tp or (self.tp,) * self.pp  # each position's ranks in a replica
        object.__setattr__(self, "_starts", tuple(sum(widths[:p]) for p in range(self.pp)))
        object.__setattr__(self, "_span", sum(widths))

    def _product_error(self) -> str:
        """Every factor, the product, the world size, and the dp that would fit."""
        product, lane = self.pp * self.dp * self.tp, self.pp * self.tp
        fix = (f"use dp={self.world_size // lane} (pp={self.pp} x tp={self.tp} x dp={self.world_size // lane} = "
               f"{self.world_size})" if self.world_size % lane == 0 else
               f"world_size={self.world_size} is not a multiple of pp x tp = {lane}: change pp or tp")
        return (f"pp={self.pp} x dp={self.dp} x tp={self.tp} = {product} ranks, but world_size="
                f"{self.world_size}; pp x dp x tp must equal the world size: {fix}")

    def _per_stage(self, name: str, widths: tuple[int, ...], unit: str, what: str, copies: int = 1) -> None:
        """`name` (stage_tp or stage_dp): one positive `unit` per stage, adding up to the world size
        (`copies` times: stage_tp's replicas of the whole pipeline)."""
        shown = list(widths)
        if len(widths) != self.pp or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
            raise ConfigError(f"{name}={shown} for {self.pp} stages; give one positive {unit} per stage")
        if sum(widths) * copies != self.world_size:
            times = f" x dp={copies}" if copies > 1 else ""
            raise ConfigError(f"{name}={shown}{times}, {sum(widths) * copies} ranks in all, on world_size="
                              f"{self.world_size}; the stages' {what}{times} must add up to the world size: "
                              f"launch {sum(widths) * copies} ranks, or change {name}")

    def _check_stage_tp(self) -> None:
        """stage_tp: one positive width per stage, their sum x dp the world size; tp the widest."""
        widths = list(self.stage_tp)
        if self.num_virtual_stages != 1:
            raise ConfigError(f"stage_tp={widths} with num_virtual_stages={self.num_virtual_stages}; "
                              "stages of different widths run one chunk per rank: no interleaving")
        self._per_stage("stage_tp", self.stage_tp, "tp", "widths", self.dp)
        if self.tp != max(widths):
            raise ConfigError(f"tp={self.tp} and stage_tp={widths}; tp is the widest stage's, {max(widths)}")

    def _check_stage_dp(self) -> None:
        """stage_dp: one positive replica count per stage, summing to the world size, at tp = dp = 1."""
        if self.dp != 1 or self.tp != 1 or self.num_virtual_stages != 1:
            raise ConfigError(f"stage_dp={list(self.stage_dp)} with dp={self.dp}, tp={self.tp}, "
                              f"num_virtual_stages={self.num_virtual_stages}; stages of different dp run one "
                              "chunk per rank, unsplit: use dp=1, tp=1, no interleaving")
        self._per_stage("stage_dp", self.stage_dp, "dp", "replicas")

    def __str__(self) -> str:
        if self.stage_dp:
            return f"pp={self.pp} x dp={list(self.stage_dp)} (per stage)"
        tp = f"{list(self.stage_tp)} (per stage)" if self.stage_tp else str(self.tp)
        virtual = f", {self.num_virtual_stages} stages per rank" if self.num_virtual_stages > 1 else ""
        return f"pp={self.pp} x dp={self.dp} x tp={tp}{virtual}"

    # -- a degree left open, solved from the world size -------------------------------------------

    @staticmethod
    def lanes_of(world_size: int, tp: int | None, pp: int | None = None, dp: int | None = None) -> int:
        """The pp x dp ranks of each tensor-parallel part (world size / tp), with pp or dp possibly
        still open (the planner's); tp=None: the world (until the planner chooses tp)."""
        if tp is None:
            return world_size
        if world_size % tp:
            factors = [f for f in range(1, world_size + 1) if world_size % f == 0]
            raise ConfigError(
                f"world size {world_size} does not factor as pp x dp x tp with tp={tp} (pp={pp}, dp={dp}); tp "
                f"must be one of {world_size}'s factors {factors}, or launch a multiple of {tp} ranks")
        return world_size // tp

    @staticmethod
    def widths_lanes(world_size: int, stage_tp: tuple[int, ...] | None, stage_dp: tuple[int, ...] | None,
                     dp: int) -> int | None:
        """With stages of different widths: their lanes, the stages x the pipeline's replicas (stage_tp
        with `dp` copies), read off the Mesh they make on `world_size` ranks (which checks the widths'
        sum x dp against it); None otherwise."""
        if stage_tp:
            mesh = Mesh(world_size, pp=len(stage_tp), dp=dp, tp=max(stage_tp), stage_tp=tuple(stage_tp))
        elif stage_dp:
            mesh = Mesh(world_size, pp=len(stage_dp), stage_dp=tuple(stage_dp))
        else:
            return None
        return mesh.pp * mesh.dp

    @staticmethod
    def stages_of_cut(layers_per_stage: tuple[int, ...] | None, split_points: tuple[str, ...] | None,
                      num_stages: int | None, num_virtual_stages: int) -> int | None:
        """The pipeline positions a cut gives (its stages / num_virtual_stages), else `num_stages`
        (None: open, solved by `pp_of`)."""
        if layers_per_stage is not None:
            return len(layers_per_stage) // num_virtual_stages
        if split_points is not None:
            return (len(split_points) + 1) // num_virtual_stages
        return num_stages

    @staticmethod
    def pp_of(lanes: int, dp: int, pp: int | None = None, tp: int = 1, given: str = "") -> int:
        """The pipeline positions of `lanes` ranks (world / tp) at `dp` replicas: `pp` checked when
        given (`given` says where it came from), else lanes / dp."""
        if pp is None:
            if lanes % dp:
                raise ConfigError(f"world size {lanes} does not divide by dp={dp}; launch a multiple "
                                  f"of {dp} ranks, or set dp to a factor of {lanes}")
            return lanes // dp
        if pp * dp != lanes:
            ranks = pp * dp * tp
            raise ConfigError(
                f"the config asks for {pp} pipeline stages x dp={dp} replicas{f' x tp={tp}' if tp > 1 else ''} = "
                f"{ranks} ranks ({given}dp={dp}) but the world size is {lanes * tp}; launch "
                f"{ranks} ranks (plait run -n {ranks} ...) or change the config")
        return pp

    # -- a stage's and a rank's place ---------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        """The model's stages: pp x num_virtual_stages."""
        return self.pp * self.num_virtual_stages

    def dp_of(self, stage_index: int) -> int:
        """The replicas of one stage (`dp` unless stage_dp gives each stage's)."""
        return self.stage_dp[stage_index % self.pp] if self.stage_dp else self.dp

    def tp_of(self, stage_index: int) -> int:
        """The tp ranks of one stage (`tp` unless stage_tp gives each stage's)."""
        return self.stage_tp[stage_index % self.pp] if self.stage_tp else self.tp

    def position_of_stage(self, stage_index: int) -> int:
        """The pipeline position whose ranks run a stage."""
        return stage_index % self.pp

    def rank_of(self, stage_index: int, replica: int = 0, tp_rank: int = 0) -> int:
        """The rank that runs part `tp_rank` of stage `stage_index` of replica `replica`."""
        if not (0 <= stage_index < self.num_chunks and 0 <= replica < self.dp_of(stage_index)
                and 0 <= tp_rank < self.tp_of(stage_index)):
            raise ConfigError(f"stage {stage_index}, replica {replica}, tp rank {tp_rank} is not a place on the "
                              f"mesh {self}: {self.num_chunks} stages, each with dp_of(stage) replicas of "
                              "tp_of(stage) ranks")
        start = self._starts[stage_index % self.pp]
        if self.stage_dp:  # a stage's replicas sit where its tp ranks would
            return start + replica
        return replica * self._span + start + tp_rank

    def coordinates(self, rank: int) -> Coordinates:
        """(position, replica, tp rank) of a rank: `rank_of`'s inverse at the rank's first stage."""
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ConfigError(f"rank {rank} is not in the plan's {self.world_size} ranks ({self})")
        replica, within = divmod(rank, self._span)
        position = bisect_right(self._starts, within) - 1
        index = within - self._starts[position]
        return Coordinates(position, index, 0) if self.stage_dp else Coordinates(position, replica, index)

    def position_of(self, rank: int) -> tuple[int, int]:
        """(position in the pipeline, replica) of a rank; the position is its first stage."""
        position, replica, _ = self.coordinates(rank)
        return position, replica

    def tp_rank_of(self, rank: int) -> int:
        """Which part of its stages' split tensors a rank holds."""
        return self.coordinates(rank).tp_rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank runs, in model order."""
        return tuple(range(self.coordinates(rank).position, self.num_chunks, self.pp))

    # -- ranks that work together ---------------------------------------------------------------

    def stage_ranks(self, stage_index: int, replica: int = 0) -> tuple[int, ...]:
        """The ranks of one stage of one replica, in tp order."""
        return tuple(self.rank_of(stage_index, replica, t) for t in range(self.tp_of(stage_index)))

    def replica_ranks(self, stage_index: int, tp_rank: int = 0) -> tuple[int, ...]:
        """Part `tp_rank` of one stage on each of its replicas, in replica order."""
        return tuple(self.rank_of(stage_index, r, tp_rank) for r in range(self.dp_of(stage_index)))

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of this rank's tp group (itself alone on a stage of one rank)."""
        position, replica, _ = self.coordinates(rank)
        return self.stage_ranks(position, replica)

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        """This rank's place on every replica of its stage (itself alone on a stage of one replica)."""
        position, _, t = self.coordinates(rank)
        return self.replica_ranks(position, t)

    def lane_ranks(self, rank: int) -> tuple[int, ...]:
        """The rank of each stage on this rank's lane: its own replica and tp rank, or the last of a
        stage with fewer (the schedule's programs are made on the lane; crossings join the widths)."""
        _, replica, t = self.coordinates(rank)
        return tuple(self.rank_of(s, min(replica, self.dp_of(s) - 1), min(t, self.tp_of(s) - 1))
                     for s in range(self.num_chunks))

    # -- every group of each axis, in one order every rank follows ----------------------------------

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Each stage's tp ranks of each replica (stages of more than one), replica by replica."""
        return [self.stage_ranks(p, r) for r in range(self.dp) for p in range(self.pp) if self.tp_of(p) > 1]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """For each (position, tp rank) of a stage of several replicas, the ranks of its replicas."""
        return [self.replica_ranks(p, t) for p in range(self.pp) for t in range(self.tp_of(p)) if self.dp_of(p) > 1]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """The lanes: for each replica and tp rank, the rank at each position (a narrower stage's
        last rank serves the lanes past its width), each lane once."""
        lanes = (tuple(self.rank_of(p, min(r, self.dp_of(p) - 1), min(t, self.tp_of(p) - 1)) for p in range(self.pp))
                 for r in range(max(self.stage_dp or (self.dp,))) for t in range(self.tp))
        return list(dict.fromkeys(lanes))
