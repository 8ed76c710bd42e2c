"""The interpreter records what it runs: with trace_dir every action of every step is in the trace."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import plait
from plait.runtime.interpreter import _ReceivesAhead, forwards_done_after
from plait.schedule import Action, generate, parse_action
from tests.harness import run_ranks
from tests.models import mlp


def traced_fit(rank, world, trace_dir, schedule, extra):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    config = plait.Config(num_microbatches=4, schedule=schedule, trace_dir=trace_dir, dp=extra.get("dp", 1),
                          num_virtual_stages=extra.get("v", 1))
    model = plait.Model(mlp(), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss())
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)  # 3 steps; fit writes the trace at its end
    return list(model.plan.stage_to_rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, extra", [("1f1b", {}), ("zbh1", {}), ("interleaved", {"v": 2}),
                                             ("gpipe", {"dp": 2})])
def test_trace_holds_every_action_of_every_step(tmp_path, schedule, extra):
    world = 2 * extra.get("dp", 1) if extra.get("dp", 1) > 1 else 2
    run_ranks(world, traced_fit, str(tmp_path), schedule, extra, timeout=110)
    v = extra.get("v", 1)
    program = generate(schedule, 2 * v, 4, num_virtual_stages=v)
    for rank in range(world):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        events = doc["traceEvents"]
        assert doc["plait"]["schedule"] == schedule and doc["plait"]["rank"] == rank
        assert {e["pid"] for e in events} == {rank}  # one process per rank
        names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"compute", "send", "recv", "wait"} <= names
        spans = [e for e in events if e["ph"] == "X"]
        steps = sorted({e["args"]["step"] for e in spans if "step" in e["args"]})
        assert len(steps) == 3
        for step in steps:
            got = [e["name"] for e in sorted(spans, key=lambda e: e["ts"])
                   if e["args"].get("step") == step and e["cat"] in ("compute", "send", "recv")
                   and not e["name"].startswith("post ")]  # receives posted ahead: their own spans
            want = [str(a) for a in program[rank % 2]] + ["optimizer"]
            assert got == want, (rank, step)
        posted = [e["name"].removeprefix("post ") for e in spans if e["name"].startswith("post ")]
        receives = [str(a) for a in program[rank % 2] if a.op.value in ("RF", "RB")]
        assert sorted(posted) == sorted(receives * len(steps))  # every receive posted once a step
        if extra.get("dp", 1) > 1:
            assert any(e["cat"] == "allreduce" for e in spans)
        assert all(e["dur"] >= 0 for e in spans)


def offered(program: str, window: int, unpostable: set[str]) -> list[str]:
    """What `_ReceivesAhead` offers before each action: `"step: receives"` per step with offers."""
    actions = [parse_action(t) for t in program.split()]
    ahead = _ReceivesAhead(actions, window)
    out = []
    for position, action in enumerate(actions):
        got: list[str] = []

        def post(receive: Action) -> bool:
            got.append(str(receive))
            return str(receive) not in unpostable

        ahead.post_due(position, post)
        if got:
            out.append(f"{position} {action}: {' '.join(got)}")
    return out


RANK_1 = "1RF0 1F0 1SF0 1RF1 1F1 1SF1 1RB0 1B0 1SB0 1RB1 1B1 1SB1"  # GPipe's middle rank of 3


def test_receives_ahead_are_offered_in_program_order_within_the_window() -> None:
    # later steps: every shape is known, each receive is posted once, at most 2 at a time
    assert offered(RANK_1, 2, set()) == [
        "0 1RF0: 1RF0 1RF1", "1 1F0: 1RB0", "4 1F1: 1RB1",
    ]


def test_a_rank_that_opens_with_compute_posts_after_its_first_send() -> None:
    # the first stage: its first activation goes out before it posts the gradients' receives
    # (posting them first delayed 0F0, and with it the whole pipeline, by ~0.2 ms a step)
    assert offered("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1", 2, set()) == ["2 0F1: 0RB0 0RB1"]
    # the last stage opens with a receive: posting starts there
    assert offered("1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1", 2, set()) == ["0 1RF0: 1RF0 1RF1"]


def test_receives_ahead_stop_behind_one_that_cannot_be_posted() -> None:
    # first step: 1RF0's shapes are unknown, so it is taken unposted at its action, and no
    # later receive is posted before that (under NCCL, which ignores tags, a posted 1RF1
    # would take micro-batch 0's message); then 1RB0 cannot be posted before 1SF0 has run
    # (its shapes are those sent), so 1RB1 waits behind it too
    assert offered(RANK_1, 8, {"1RF0", "1RB0"}) == [
        "0 1RF0: 1RF0", "1 1F0: 1RF1 1RB0", "7 1B0: 1RB1",
    ]
    # every receive is still offered exactly once, before its action
    assert offered(RANK_1, 1, {"1RF0", "1RF1", "1RB0", "1RB1"}) == [
        "0 1RF0: 1RF0", "1 1F0: 1RF1", "4 1F1: 1RB0", "7 1B0: 1RB1",
    ]


def test_forwards_are_done_after_the_last_forward_or_before_the_first_weights_after_it() -> None:
    def after(program: str, at_weights: bool) -> str:
        actions = [parse_action(t) for t in program.split()]
        i = forwards_done_after(actions, at_weights)
        return "start" if i < 0 else str(actions[i])

    last_stage = "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1W0 1W1"  # ZB-H1, 2 stages, 2 micro-batches
    assert after(last_stage, False) == "1F1"
    # the input gradient its previous stage waits for goes out first; the sums ride before W
    assert after(last_stage, True) == "1SB1"
    first_stage = "0F0 0SF0 0F1 0SF1 0RB0 0B0 0W0 0RB1 0B1 0W1"
    assert after(first_stage, True) == "0B0"
    one_f_one_b = "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1"  # no W: the last forward either way
    assert after(one_f_one_b, True) == after(one_f_one_b, False) == "1F1"
    assert after("0RB0 0B0 0W0", True) == "start"  # no forward in this program
