"""A schedule added in one place, one `ScheduleSpec` registered, is validated, simulated, priced, planned and run.

The toy is 1F1B with a deeper warm-up: stage s runs min(2(p - s - 1), m) forwards before its
first backward, not 1F1B's min(p - s - 1, m). It holds more (stage s: min(2(p - s) - 1, m)
micro-batches, 3 against 1F1B's 2 on stage 0 of 2) and in return hides hand-overs: with 0.5 s
each way beside F = 2 s and B = 4 s a stage, 2 stages and 4 micro-batches step in 31 s, 1F1B in
32 s. Nothing else in plait names it: what the planner, the cost model and the runtime need
comes from its spec.
"""

from __future__ import annotations

import math

import pytest

from plait.config import Config
from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting, peak_activations, predict
from plait.errors import ConfigError, ScheduleError
from plait.planner.choice import search_space
from plait.schedule import Action, Op, Program, format_program, generate, simulate
from plait.schedule.generators import order_1f1b
from plait.schedule.registry import SCHEDULE_NAMES, SCHEDULES, SEARCH_ORDER, register, schedule_spec, unregister
from plait.schedule.spec import ClosedForm, ScheduleSpec
from plait.search.search import SearchSpace, search
from tests.harness import run_ranks
from tests.plan.factory import layer_costs
from tests.test_equivalence import check_case

CALLS: list[tuple[int, int]] = []  # (stages, micro-batches) the toy's generator was asked for, in this process


def _order(num_stages: int, num_microbatches: int, warmup: list[int]) -> Program:
    program: Program = {}
    for s in range(num_stages):
        forwards = [Action(s, Op.FORWARD, k) for k in range(num_microbatches)]
        backwards = [Action(s, Op.BACKWARD, k) for k in range(num_microbatches)]
        program[s] = order_1f1b(forwards, backwards, warmup[s])
    return program


def eager_1f1b(num_stages: int, num_microbatches: int) -> Program:
    """1F1B with twice its warm-up: min(2(p - s - 1), m) forwards first on stage s."""
    CALLS.append((num_stages, num_microbatches))
    p, m = num_stages, num_microbatches
    return _order(p, m, [min(2 * (p - s - 1), m) for s in range(p)])


def eager_peaks(p: int, m: int, v: int, recompute: bool) -> tuple[float, ...]:
    return tuple(float(min(2 * (p - s) - 1, m)) for s in range(p))


# The one place the toy is given: its generator, its peaks, the closed form that times it.
TOY = ScheduleSpec("eager1f1b", eager_1f1b, eager_peaks, closed_form=ClosedForm.PLAIN)


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)
    assert TOY.name not in SCHEDULE_NAMES


def lines(program: Program) -> list[str]:
    return format_program(program).splitlines()


# --- validated: registered through the dry run, refused when its spec misstates its program


def test_registered_schedule_is_listed_and_generated(toy) -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zbh1", "eager1f1b")
    assert SEARCH_ORDER == ("1f1b", "gpipe", "zbh1", "interleaved", "eager1f1b")  # search_order 100: last
    assert SCHEDULES["eager1f1b"] is eager_1f1b and schedule_spec("eager1f1b") is TOY
    assert lines(generate("eager1f1b", 2, 5)) == [  # stage 0 runs 2 forwards ahead, not 1F1B's 1
        "rank 0: 0F0 0SF0 0F1 0SF1 0F2 0SF2 0RB0 0B0 0F3 0SF3 0RB1 0B1 0F4 0SF4 0RB2 0B2 0RB3 0B3 0RB4 0B4",
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1RF2 1F2 1B2 1SB2 1RF3 1F3 1B3 1SB3 1RF4 1F4 1B4 1SB4",
    ]
    assert lines(generate("eager1f1b", 2, 2, forward_only=True)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1", "rank 1: 1RF0 1F0 1RF1 1F1",
    ]
    with pytest.raises(ScheduleError, match="schedule 'eager1f1b' is already registered; unregister it first"):
        register(TOY)
    with pytest.raises(ScheduleError, match=r"'eager1f1b' runs one stage per rank.*use schedule='interleaved'"):
        generate("eager1f1b", 4, 2, num_virtual_stages=2)


def _refused(spec: ScheduleSpec, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        register(spec)
    assert spec.name not in SCHEDULE_NAMES and spec.name not in SEARCH_ORDER


def test_a_misstated_spec_is_refused_and_not_listed() -> None:
    _refused(ScheduleSpec("wrong-peaks", eager_1f1b, schedule_spec("1f1b").peak_activations),
             r"schedule 'wrong-peaks' on 2 ranks, 3 micro-batches: peak_activations gives \[2.0, 1.0\], "
             r"but the program holds \[3.0, 1.0\] micro-batches per rank; fix its closed form")
    _refused(ScheduleSpec("wrong-split", eager_1f1b, eager_peaks, splits_backward=True),
             "its program has no W actions; set splits_backward=False")
    _refused(ScheduleSpec("wrong-all", eager_1f1b, eager_peaks, holds_all_microbatches=True),
             r"holds_all_microbatches=True, but the program holds \[3.0, 1.0\] of 3")
    # warm-up growing with the stage: stage 0 waits for a gradient stage 1 cannot send before
    # stage 0's next forward; the dry run finds it
    backwards = ScheduleSpec("deadlock", lambda p, m: _order(p, m, [min(s, m) for s in range(p)]), eager_peaks)
    _refused(backwards, "deadlock")
    with pytest.raises(ScheduleError, match="the interleaved closed form needs virtual=True"):
        ScheduleSpec("flat", eager_1f1b, eager_peaks, closed_form=ClosedForm.INTERLEAVED)
    with pytest.raises(ScheduleError, match="unknown schedule 'eager1f1b'; known schedules: 1f1b, gpipe"):
        schedule_spec("eager1f1b")


# --- simulated


def test_simulated_from_its_program(toy) -> None:
    free = simulate("eager1f1b", 3, 4, 1, 1)
    assert free.step_time == simulate("1f1b", 3, 4, 1, 1).step_time == 12.0  # (m + p - 1)(F + B)
    assert free.peak_activations == [4.0, 3.0, 1.0] == list(eager_peaks(3, 4, 1, False))
    # the deeper warm-up keeps stage 0 busy while hand-overs travel
    assert simulate("eager1f1b", 3, 4, 1, 2, t_comm=0.5).step_time == 20.0
    assert simulate("1f1b", 3, 4, 1, 2, t_comm=0.5).step_time == 22.0


# --- priced: by the cost model, and by the planner's search among the built-in schedules

COSTS = layer_costs(4, forward=1.0, backward=2.0, output=5e5, activation=10.0)  # 2 rows: F 2 s, B 4 s a stage
NETWORK = Network(Link(0.0, 1e6), Link(0.0, 1e6), 1)  # 0.5 MB a row: 0.5 s a hand-over


def test_priced_by_the_cost_model(toy) -> None:
    setting = Setting(2, 1, 4, "eager1f1b")
    assert peak_activations(setting) == (3.0, 1.0)
    cluster = Cluster(NETWORK, math.inf, optimizer_state_factor=0.0)
    simulated = predict(COSTS, setting, cluster, 4, (2, 2))
    assert (simulated.method, simulated.pipeline_s, simulated.activation_bytes) == ("simulated", 31.0, (60.0, 20.0))
    one_f_one_b = predict(COSTS, Setting(2, 1, 4, "1f1b"), cluster, 4, (2, 2))
    assert (one_f_one_b.pipeline_s, one_f_one_b.activation_bytes) == (32.0, (40.0, 20.0))
    closed = predict(COSTS, setting, cluster, 4, (2, 2), simulate=False)  # 1F1B's closed form (ClosedForm.PLAIN)
    assert (closed.method, closed.pipeline_s) == ("closed form", 31.0)


def test_searched_by_the_planner(toy) -> None:
    space, how = search_space(Config(), 2, 4)
    assert how == "planned" and space.schedules == ("1f1b", "gpipe", "zbh1", "interleaved", "eager1f1b")
    assert SearchSpace().schedules[-1] == "eager1f1b"
    space = SearchSpace(pp=(2,), num_microbatches=(4,), schedules=("1f1b", "eager1f1b"), recompute=(False,),
                        batch_weight_grads=(False,))

    def best(memory_bytes: float) -> tuple[str, float, tuple[int, ...]]:
        found = search(COSTS, 2, 4, Cluster(NETWORK, memory_bytes, optimizer_state_factor=0.0), space)[0]
        return found.setting.schedule, found.step_time_s, found.layers_per_stage

    assert best(60.0) == ("eager1f1b", 31.0, (2, 2))  # room for its 3 micro-batches on stage 0: faster
    assert best(45.0) == ("1f1b", 32.0, (2, 2))  # 60 bytes on stage 0 do not fit; 1F1B's 40 do
    with pytest.raises(ConfigError, match="num_virtual_stages=2 needs schedule='interleaved'"):
        Setting(2, 1, 4, "eager1f1b", num_virtual_stages=2)


def test_config_takes_it_while_registered() -> None:
    with pytest.raises(ConfigError, match=r"schedule='eager1f1b' is not known; choose one of \['gpipe', '1f1b', "
                                          r"'interleaved', 'zbh1'\]"):
        Config(schedule="eager1f1b")
    register(TOY)
    try:
        assert Config(schedule="eager1f1b").schedule == "eager1f1b"
        with pytest.raises(ConfigError, match="num_virtual_stages=2 needs schedule='interleaved', got schedule='eager1f1b'"):
            Config(schedule="eager1f1b", num_virtual_stages=2)
    finally:
        unregister(TOY.name)


# --- run: 2 gloo ranks train with it and match one process training a deep copy


def _train_with_toy(rank: int, world: int) -> tuple[list[str], list[tuple[int, int]]]:
    register(TOY)  # a rank starts from the fork server's plait, which has only the built-in schedules
    CALLS.clear()
    problems = check_case(rank, world, "mlp", "eager1f1b", 5, "sgd")  # losses, gradients, parameters, outputs
    return problems, list(CALLS)


@pytest.mark.timeout(240)
def test_runs_on_two_ranks_as_one_process_trains() -> None:
    results = run_ranks(2, _train_with_toy, timeout=200)
    for rank, (problems, calls) in enumerate(results):
        assert not problems, f"rank {rank}: {problems}"
        assert calls and all(stages == 2 for stages, _ in calls), calls  # its pipeline ran the toy's program
