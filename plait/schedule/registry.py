"""The one list of schedules (`register`), and `generate`: a named schedule's program, placed, lowered and validated."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import overload

from plait.errors import ScheduleError
from plait.schedule.action import Op, Program
from plait.schedule.generators import forward_only as forward_only_program
from plait.schedule.lower import check_sizes, lower_communication, place_stages
from plait.schedule.spec import BUILTIN, ScheduleSpec
from plait.schedule.validate import validate

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "SEARCH_ORDER", "register", "unregister", "schedule_spec",
           "width_schedules", "virtual_hint", "compute_program", "generate", "splits_backward"]

_SPECS: dict[str, ScheduleSpec] = {}  # name -> spec, in registration order: the one list of schedules


class _Names(Sequence[str]):
    """Registered names in one order: a tuple that `register` and `unregister` keep current, so
    a module that imported it sees a schedule registered later."""

    def __init__(self) -> None:
        self._names: tuple[str, ...] = ()

    def _set(self, names: Iterable[str]) -> None:
        self._names = tuple(names)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names[index]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __eq__(self, other: object) -> bool:
        return self._names == (tuple(other) if isinstance(other, _Names) else other)

    def __hash__(self) -> int:
        return hash(self._names)

    def __repr__(self) -> str:
        return repr(self._names)


class _Generators(Mapping[str, Callable[..., Program]]):
    """Schedule name -> generator of its compute-only program, for every registered schedule."""

    def __getitem__(self, name: str) -> Callable[..., Program]:
        return _SPECS[name].generator

    def __iter__(self) -> Iterator[str]:
        return iter(_SPECS)

    def __len__(self) -> int:
        return len(_SPECS)

    def __repr__(self) -> str:
        return repr(dict(self))


SCHEDULES: Mapping[str, Callable[..., Program]] = _Generators()
"""Schedule name -> generator (`ScheduleSpec.generator`; this package imports nothing of plait
but its errors)."""
_NAMES, _ORDER = _Names(), _Names()
SCHEDULE_NAMES: Sequence[str] = _NAMES  # registration order: the names Config.schedule accepts
SEARCH_ORDER: Sequence[str] = _ORDER  # by ScheduleSpec.search_order: equal predictions go to the first


def _relist() -> None:
    names = list(_SPECS)
    _NAMES._set(names)
    _ORDER._set(sorted(names, key=lambda n: (_SPECS[n].search_order, names.index(n))))


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec registered as `name`; ScheduleError naming the known ones otherwise."""
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(sorted(_SPECS))}")
    return spec


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add `spec` to the one list once its programs pass the dry run and agree with what it
    states (`_check`); ScheduleError, and nothing registered, otherwise."""
    if not isinstance(spec, ScheduleSpec):
        raise ScheduleError(f"register takes a ScheduleSpec, got {type(spec).__name__}")
    if spec.name in _SPECS:
        raise ScheduleError(f"schedule {spec.name!r} is already registered; unregister it first or choose "
                            "another name")
    _SPECS[spec.name] = spec
    _relist()
    try:
        _check(spec)
    except BaseException:
        unregister(spec.name)
        raise
    return spec


def unregister(name: str) -> ScheduleSpec:
    """Remove schedule `name` from the list and return its spec."""
    spec = schedule_spec(name)
    del _SPECS[name]
    _relist()
    return spec


def _held(program: Program, num_ranks: int, num_virtual_stages: int, split: bool) -> list[float]:
    """Most micro-batches each rank holds at once: an F done, its B (W when split) not yet."""
    release = Op.WEIGHT if split else Op.BACKWARD
    peaks = []
    for rank in range(num_ranks):
        held = peak = 0
        for action in program.get(rank, []):
            held += (action.op is Op.FORWARD) - (action.op is release)
            peak = max(peak, held)
        peaks.append(peak / num_virtual_stages)
    return peaks


def _check(spec: ScheduleSpec) -> None:
    """Dry-run `spec`'s programs on 2 and 3 ranks (`generate` validates them; a virtual one
    generates its inference program too) and hold its split backward and peaks to them."""
    v = 2 if spec.virtual else 1
    for p, m in ((2, 3), (3, 5)):
        if spec.virtual:
            generate(spec.name, p * v, m, num_virtual_stages=v, forward_only=True)
        program = generate(spec.name, p * v, m, num_virtual_stages=v)
        where = f"schedule {spec.name!r} on {p} ranks, {m} micro-batches"
        split = splits_backward(program)
        if split != spec.splits_backward:
            raise ScheduleError(f"{where}: splits_backward={spec.splits_backward}, but its program has "
                                f"{'' if split else 'no '}W actions; set splits_backward={split}")
        held, stated = _held(program, p, v, split), list(spec.peak_activations(p, m, v, False))
        if len(stated) != p or any(abs(a - b) > 1e-9 for a, b in zip(stated, held)):
            raise ScheduleError(f"{where}: peak_activations gives {stated}, but the program holds {held} "
                                "micro-batches per rank; fix its closed form")
        if spec.holds_all_microbatches and held != [float(m)] * p:
            raise ScheduleError(f"{where}: holds_all_microbatches=True, but the program holds {held} of {m}")


def width_schedules() -> tuple[str, ...]:
    """The schedules stages of different widths may run, in the planner's order."""
    return tuple(n for n in SEARCH_ORDER if _SPECS[n].mixed_widths)


def virtual_hint() -> str:
    """The schedules of several chunks per rank, for messages: "schedule='interleaved'"."""
    return " or ".join(f"schedule={n!r}" for n, s in _SPECS.items() if s.virtual) or "a virtual schedule"


def compute_program(
    name: str, num_chunks: int, num_microbatches: int, forward_only: bool = False, num_virtual_stages: int = 1
) -> tuple[Program, dict[int, int] | None]:
    """The generator's program (keyed by pipeline position) and its default stage_to_rank."""
    spec = schedule_spec(name)
    if spec.virtual:
        program = spec.generator(
            num_chunks, num_microbatches, num_virtual_stages, forward_only=forward_only
        )
        p = num_chunks // num_virtual_stages
        return program, {s: s % p for s in range(num_chunks)}
    if num_virtual_stages != 1:
        raise ScheduleError(
            f"schedule {name!r} runs one stage per rank, but num_virtual_stages="
            f"{num_virtual_stages!r}; use {virtual_hint()} for several stages per rank, "
            f"or num_virtual_stages=1"
        )
    make = forward_only_program if forward_only else spec.generator
    return make(num_chunks, num_microbatches), None


def generate(
    name: str,
    num_chunks: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    stage_to_rank: dict[int, int] | None = None,
    num_virtual_stages: int = 1,
) -> Program:
    """The runnable program of schedule `name`: generated, placed, lowered and validated.

    `num_chunks` counts model chunks (stages of the model): with "interleaved" that is S = p * v for p pipeline
    ranks of `num_virtual_stages` (v) stages each, stage s on rank s % p unless `stage_to_rank`
    says otherwise; every other schedule has v = 1 and stage s on rank s by default.
    `forward_only=True` gives the inference program (no backward) whatever the name, but the
    name must still be known. `stage_to_rank` may put several stages on one rank; their
    actions are then merged in clock-cycle order (`place_stages`) and the hand-overs between
    them are local, so no SF/RF or SB/RB is inserted for them.
    """
    check_sizes(num_chunks, num_microbatches)
    compute, default_ranks = compute_program(
        name, num_chunks, num_microbatches, forward_only, num_virtual_stages
    )
    ranks = default_ranks if stage_to_rank is None else stage_to_rank
    placed = place_stages(compute, num_chunks, ranks)
    program = lower_communication(placed, num_chunks, ranks)
    validate(program, num_chunks, num_microbatches, ranks, forward_only=forward_only)
    return program


def splits_backward(program: Program) -> bool:
    """True if `program` splits the backward into B (input gradient) and W (weight gradient)."""
    return any(action.op is Op.WEIGHT for actions in program.values() for action in actions)


for _spec in BUILTIN:
    register(_spec)
