"""The `Plan`: how the model is laid out on the ranks, as printable JSON-ready data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from plait.errors import ConfigError
from plait.plan.mesh import Mesh

__all__ = ["Plan", "CROSSINGS", "PRECISIONS"]

CROSSINGS = ("tiles", "whole")  # how a value crosses between stages of different tp widths (Config.crossing)
PRECISIONS = ("fp32", "bf16", "fp16")  # the dtype stages compute in (Config.precision)


@dataclass(frozen=True)
class Plan:
    """Layers per stage, schedule and rank layout of one run."""

    layer_names: tuple[str, ...]
    layers_per_stage: tuple[int, ...]
    num_microbatches: int
    schedule: str
    world_size: int
    capture_method: str
    uncuttable: tuple[tuple[int, int], ...] = ()
    tied_parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()  # name -> stages holding it
    stage_to_rank: tuple[int, ...] = field(default=())  # replica 0's ranks
    dp: int = 1
    num_virtual_stages: int = 1  # model chunks per rank (interleaved schedule)
    recompute: tuple[int, ...] = ()  # stages that recompute their forward during the backward
    recompute_by_layer: tuple[int, ...] = ()  # of those, the ones that recompute it layer by layer
    check: str = ""  # the closed loop: measured against predicted step and stage times, once known
    kept_whole: tuple[str, ...] = ()  # modules captured as one opaque call each (not traced into)
    memory: str = field(default="", compare=False)  # printed only: this rank's memory, measured / predicted
    zero: int = 0  # 1: each stage's optimizer state sharded over its replicas (ZeRO-1); 2: gradients too; 3: parameters too
    tp: int = 1  # tensor-parallel ranks per stage (innermost: consecutive ranks)
    batch_weight_grads: bool = False  # linears' weight gradients once a step over all micro-batches
    # per stage (tp > 1): {"parameters": {name: {"placement": "Shard(d)", "blocks"}}, "activations":
    # {graph value: "Shard(d)" | "Partial() -> Replicate()"} (any other: Replicate()), "collectives":
    # [{"kind", "pass", "at", "why"}], "replicated": {module: why}, "search": the tp search's choice,
    # when a memory limit made it: {"split", "whole", "ops", "state_bytes", "limit_bytes", "seconds"}}
    # (`TpLayout.data`)
    tp_layouts: tuple[dict[str, Any], ...] = ()
    # per stage, when stages differ: its tp ranks (dp = 1; `tp` is then the widest; see `Mesh`)
    stage_tp: tuple[int, ...] = ()
    crossing: str = "tiles"  # with stage_tp: how values cross between widths (Config.crossing)
    # per stage, when stages differ: its data-parallel replicas (`dp` and `tp` are then 1; see `Mesh`)
    stage_dp: tuple[int, ...] = ()
    # with tp > 1: the user's pinned strategies ((module pattern, "colwise" | "rowwise" | "vocab" |
    # "replicate"), in order) that the tp layout search keeps, and Megatron's sequence parallelism
    tp_plan: tuple[tuple[str, str], ...] = ()
    sequence_parallel: bool = False
    # the dtype stages compute in: "bf16" / "fp16" copies of fp32 master parameters (Config.precision)
    precision: str = "fp32"
    # zero=3: the shards, their gradients and the optimizer step in host memory (on GPU ranks; Config.offload)
    offload: bool = False

    def __post_init__(self) -> None:
        for name in ("num_virtual_stages", "num_microbatches"):  # the mesh checks its degrees
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"plan has {name}={value!r}; it must be a positive integer")
        if not self.layers_per_stage or any(not isinstance(c, int) or c < 1 for c in self.layers_per_stage):
            raise ConfigError(
                f"plan has layers_per_stage={list(self.layers_per_stage)}; every stage needs a "
                "positive whole number of layers"
            )
        if sum(self.layers_per_stage) != len(self.layer_names):
            raise ConfigError(
                f"plan has layers_per_stage={list(self.layers_per_stage)} for "
                f"{len(self.layer_names)} layers"
            )
        if self.num_chunks % self.num_virtual_stages:
            raise ConfigError(
                f"plan has {self.num_chunks} stages, not a multiple of num_virtual_stages="
                f"{self.num_virtual_stages}; every rank holds the same number of chunks"
            )
        if self.stage_tp and self.tp == 1 and all(isinstance(w, int) for w in self.stage_tp):
            object.__setattr__(self, "tp", max(self.stage_tp))  # tp: the widest stage's
        self.mesh  # checks the degrees and widths against the world size, once
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"plan has zero={self.zero!r}; it must be 0, 1, 2 or 3")
        if self.offload and self.zero != 3:
            raise ConfigError(f"plan has offload=True with zero={self.zero}; offload moves zero=3's shards: use zero=3")
        if self.stage_dp and self.zero and max(self.stage_dp) == 1:
            raise ConfigError(f"plan has stage_dp={list(self.stage_dp)} with zero={self.zero}; ZeRO shards a stage's "
                              "state over its replicas and no stage has two: use zero=0")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"plan has precision={self.precision!r}; it must be one of {list(PRECISIONS)}")
        if self.crossing not in CROSSINGS:
            raise ConfigError(f"plan has crossing={self.crossing!r}; it must be one of {list(CROSSINGS)}")
        if not self.stage_to_rank:
            object.__setattr__(self, "stage_to_rank", tuple(self.rank_of(s, 0) for s in range(self.num_chunks)))

    @cached_property
    def mesh(self) -> Mesh:
        """The ranks' named axes: which rank runs what (every question of place is the mesh's)."""
        return Mesh(world_size=self.world_size, pp=self.pp, dp=self.dp, tp=self.tp,
                    num_virtual_stages=self.num_virtual_stages, stage_tp=self.stage_tp, stage_dp=self.stage_dp)

    def dp_of(self, stage_index: int) -> int:
        """The data-parallel replicas of one stage (`dp` unless stage_dp gives each stage's)."""
        return self.mesh.dp_of(stage_index)

    def tp_of(self, stage_index: int) -> int:
        """The tp ranks of one stage (`tp` unless stage_tp gives the stages' widths)."""
        return self.mesh.tp_of(stage_index)

    @property
    def num_chunks(self) -> int:
        """The model's pieces (its stages): num_stages x num_virtual_stages, one entry of
        layers_per_stage each."""
        return len(self.layers_per_stage)

    @property
    def num_stages(self) -> int:
        """Ranks per pipeline replica (as in Config); each runs num_virtual_stages chunks."""
        return self.num_chunks // self.num_virtual_stages

    @property
    def pp(self) -> int:
        """Ranks per pipeline replica: the pipeline-parallel degree (= num_stages)."""
        return self.num_stages

    def rank_of(self, stage_index: int, replica: int, tp_rank: int = 0) -> int:
        """The rank that runs part `tp_rank` of `stage_index` of pipeline replica `replica` (the
        layout: `Mesh`)."""
        return self.mesh.rank_of(stage_index, replica, tp_rank)

    def position_of(self, rank: int) -> tuple[int, int]:
        """(position in the pipeline, replica) of a rank; the position is its first stage."""
        return self.mesh.position_of(rank)

    def tp_rank_of(self, rank: int) -> int:
        """Which part of its stages' split tensors a rank holds."""
        return self.mesh.tp_rank_of(rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank runs, in model order."""
        return self.mesh.stages_of(rank)

    def stage_layers(self, stage_index: int) -> tuple[str, ...]:
        """Names of the layers on one stage."""
        start = sum(self.layers_per_stage[:stage_index])
        return self.layer_names[start : start + self.layers_per_stage[stage_index]]

    def _widths_text(self) -> str:
        if self.stage_tp:
            return f" x tp={list(self.stage_tp)} (per stage, crossing as {self.crossing})"
        if self.stage_dp:
            return f" x dp={list(self.stage_dp)} (per stage)"
        return f" x tp={self.tp}" if self.tp > 1 else ""

    def to_json(self) -> str:
        data = asdict(self)
        del data["memory"]  # one rank's reading, not the plan
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data: dict[str, Any] = json.loads(text)
            return cls(
                layer_names=tuple(data["layer_names"]),
                layers_per_stage=tuple(data["layers_per_stage"]),
                num_microbatches=int(data["num_microbatches"]),
                schedule=str(data["schedule"]),
                world_size=int(data["world_size"]),
                capture_method=str(data["capture_method"]),
                uncuttable=tuple((int(r[0]), int(r[1])) for r in data.get("uncuttable", ())),
                tied_parameters=tuple(
                    (str(n), tuple(s)) for n, s in data.get("tied_parameters", ())
                ),
                stage_to_rank=tuple(data.get("stage_to_rank", ())),
                dp=int(data.get("dp", 1)),
                num_virtual_stages=int(data.get("num_virtual_stages", 1)),
                recompute=tuple(int(s) for s in data.get("recompute", ())),
                recompute_by_layer=tuple(int(s) for s in data.get("recompute_by_layer", ())),
                check=str(data.get("check", "")),
                kept_whole=tuple(str(n) for n in data.get("kept_whole", ())),
                zero=int(data.get("zero", 0)),
                tp=int(data.get("tp", 1)),
                batch_weight_grads=bool(data.get("batch_weight_grads", False)),
                tp_layouts=tuple(_layout(s) for s in data.get("tp_layouts", ())),
                stage_tp=tuple(int(w) for w in data.get("stage_tp", ())),
                crossing=str(data.get("crossing", "tiles")),
                stage_dp=tuple(int(w) for w in data.get("stage_dp", ())),
                tp_plan=tuple((str(p), str(s)) for p, s in data.get("tp_plan", ())),
                sequence_parallel=bool(data.get("sequence_parallel", False)),
                precision=str(data.get("precision", "fp32")),
                offload=bool(data.get("offload", False)),
            )
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError) as e:
            raise ConfigError(f"not a plait plan ({type(e).__name__}: {e}); expected Plan.to_json() output") from e

    def __str__(self) -> str:
        lines = [
            f"plait plan: {self.num_chunks} stage(s)"
            f"{f' ({self.num_virtual_stages} per rank)' if self.num_virtual_stages > 1 else ''}"
            f"{'' if self.stage_dp else f' x {self.dp} replica(s)'}{self._widths_text()} on {self.world_size} rank(s), schedule "
            f"{self.schedule}, {self.num_microbatches} micro-batch(es)"
            f"{', weight gradients batched' if self.batch_weight_grads else ''}"
            f"{f', computed in {self.precision} over fp32 master weights' if self.precision != 'fp32' else ''}, captured with "
            f"{self.capture_method}, {len(self.layer_names)} layers"
        ]
        for s in range(self.num_chunks):
            names = self.stage_layers(s)
            shown = ", ".join(names) if len(names) <= 8 else (
                ", ".join(names[:3]) + f", ... ({len(names) - 6} more) ..., " + ", ".join(names[-3:])
            )
            ranks = ", ".join("-".join(str(self.rank_of(s, r, t)) for t in sorted({0, self.tp_of(s) - 1}))
                              for r in range(self.dp_of(s)))
            where = f"rank {ranks}" if self.dp_of(s) == 1 and self.tp_of(s) == 1 else f"ranks {ranks}"
            again = ", recomputed" if s in self.recompute else ""
            again += " layer by layer" if s in self.recompute_by_layer else ""
            lines.append(f"  stage {s} ({where}{again}): {len(names)} layers: {shown}")
        if self.zero:
            what = {1: "optimizer state", 2: "optimizer state and gradients",
                    3: "parameters, gradients and optimizer state"}[self.zero]
            over = "its replicas, where it has several" if self.stage_dp else f"its {self.dp} replicas"
            kept = ", kept in host memory (offload)" if self.offload else ""
            lines.append(f"  ZeRO-{self.zero}: each stage's {what} sharded over {over}{kept}")
        for s, layout in enumerate(self.tp_layouts):
            lines += _layout_lines(s, self.tp_of(s), layout)
        if self.kept_whole:
            lines.append(f"  kept whole (one layer each, not traced into): {', '.join(self.kept_whole)}")
        for name, stages in self.tied_parameters:
            lines.append(f"  tied parameter {name}: replicated on stages {list(stages)}, gradients summed")
        if self.check:
            lines.append(f"  {self.check}")
        if self.memory:
            lines.append(f"  {self.memory}")
        return "\n".join(lines)


def _layout(data: Any) -> dict[str, Any]:
    """One stage's tp layout from the JSON (a dict of its three parts)."""
    if not isinstance(data, dict) or not set(data) <= {"parameters", "activations", "collectives", "replicated",
                                                       "search"}:
        raise TypeError(f"a stage's tp layout is {{parameters, activations, collectives, replicated[, search]}}, "
                        f"got {str(data)[:80]}")
    found = {"parameters": dict(data.get("parameters", {})), "collectives": list(data.get("collectives", [])),
             "replicated": dict(data.get("replicated", {}))}
    return {**found, **{key: dict(data[key]) for key in ("activations", "search") if data.get(key)}}


def _layout_lines(stage: int, tp: int, layout: dict[str, Any]) -> list[str]:
    """A stage's tp layout for `str(plan)`: its split parameters, collectives, and what stays whole."""
    params, collectives, whole = layout["parameters"], layout["collectives"], layout["replicated"]
    if not (params or whole):
        return []
    split = [f"{name}: {p['placement']}" + (f" in {p['blocks']} blocks" if p.get("blocks", 1) > 1 else "")
             for name, p in params.items()]
    counts: dict[str, int] = {}
    for c in collectives:
        key = f"{c['kind']} in the {c['pass']}"
        counts[key] = counts.get(key, 0) + 1
    lines = [f"  stage {stage} split over tp={tp}: " + "; ".join(split)]
    placed = layout.get("activations", {}).values()
    shards, partial = sum(1 for p in placed if p.startswith("Shard")), sum(1 for p in placed if p.startswith("Partial"))
    if shards or partial:
        lines.append(f"  stage {stage} activations: {shards} split (Shard), {partial} partial sums (Partial())")
    if counts:
        lines.append(f"  stage {stage} collectives: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    lines += [f"  stage {stage} replicated: {name} ({why})" for name, why in whole.items()]
    search = layout.get("search")
    if search:
        lines.append(f"  stage {stage} tp search: {len(search['split'])} of {search['ops']} operations split, "
                     f"{search['state_bytes']:.4g} of {search['limit_bytes']:.4g} bytes of parameter state, "
                     f"{search['seconds'] * 1e3:.4g} ms priced")
    return lines
