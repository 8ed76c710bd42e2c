"""Pipeline training equals single-process training of a deep copy: losses, gradients, parameters, outputs.

Every rank trains plait and, on the side, the deep copy in one process; each compares what it
holds and returns the mismatches. fp32 tolerances: rtol 1e-5, atol 1e-6 on parameters and
outputs; gradients are sums over micro-batches in another order, so they get atol 1e-5.

Every case gives its cut (`tests.models.even_cut`), so a failure reproduces: with no
layers_per_stage the planner would profile and cut by this run's timings. The planner's own cuts
are checked against one process in tests/planner/test_layout.py.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

import plait
from tests.harness import run_ranks
from tests.models import LAYERS, MODELS, even_cut, make

BATCH = 10


def _reference_step(ref, opt, loss_fn, x, y):
    opt.zero_grad(set_to_none=True)
    out = ref(*x) if isinstance(x, tuple) else ref(x)
    loss = loss_fn(out, y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _slice(x, a, b):
    return tuple(t[a:b] for t in x) if isinstance(x, tuple) else x[a:b]


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # Adam steps by lr * m / (sqrt(v) + eps). Where a gradient is the rounding residue of
    # cancelling terms (1e-9 to 1e-8, e.g. a nearly dead ReLU unit; the size depends on the
    # CPU's kernels), any change of summation order -- which micro-batching is -- moves that
    # step by up to lr * residue / eps. eps=1e-3 keeps that below 1e-7 of a parameter; with
    # eps=1e-4 one GPT entry differed by 1.4e-6 on an AVX-512 machine, with the default 1e-8
    # a few entries differ by 1e-3. (Default Adam holds on a Hugging Face GPT-2, whose residues
    # are ~5e-12: tests/test_adam.py.)
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)


def check_case(rank, world, name, schedule, microbatches, opt_kind, check_outputs=True, made=None,
               **config):
    net, x, y, loss_fn = made or make(name)
    if made is not None:  # the same module for every case: reset it (plait reuses its capture)
        net.load_state_dict(made_initial[id(net)])
        for p in net.parameters():
            p.grad = None
    ref = copy.deepcopy(net)
    ref_opt = _optimizer(opt_kind, ref.parameters())
    # The cut is given, so a failure reproduces: a planned cut would follow this run's timings.
    cut = even_cut(LAYERS[name], world * config.get("num_virtual_stages", 1))
    model = plait.Model(net, config=plait.Config(num_stages=world, num_microbatches=microbatches,
                                                 schedule=schedule, layers_per_stage=cut, **config),
                        optimizer=_optimizer(opt_kind, net.parameters()), loss=loss_fn)
    problems = []
    rows = y.shape[0]
    for a in range(0, rows, BATCH):
        xb, yb = _slice(x, a, a + BATCH), y[a:a + BATCH]
        got = model.train_on_batch(xb, yb)
        want = _reference_step(ref, ref_opt, loss_fn, xb, yb)
        if abs(got - want) > 1e-5 * abs(want) + 1e-6:
            problems.append(f"loss at rows {a}: {got} != {want}")
    ref_params = dict(ref.named_parameters())
    for pname, p in net.named_parameters():
        if p.grad is not None:  # the parameters this rank trains
            try:
                torch.testing.assert_close(p.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-5)
            except AssertionError as e:
                problems.append(f"grad {pname}: {e}")
    state = model.state_dict()
    want_state = ref.state_dict()
    if list(state) != list(want_state):
        problems.append(f"state_dict keys {list(state)} != {list(want_state)}")
    for k, v in want_state.items():
        try:
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
        except (AssertionError, KeyError) as e:
            problems.append(f"param {k}: {e}")
    if check_outputs:  # evaluation captures a second (eval-mode) graph: done on a subset for time
        ref.eval()
        with torch.no_grad():
            want_out = ref(*x) if isinstance(x, tuple) else ref(x)
        got_out = model.predict(x, batch_size=BATCH)
        if type(got_out) is not type(want_out):
            problems.append(f"predict returned {type(got_out)}, the model returns {type(want_out)}")
        try:
            torch.testing.assert_close(_tensors(got_out), _tensors(want_out), rtol=1e-5, atol=1e-5)
        except (AssertionError, TypeError) as e:
            problems.append(f"predict: {e}")
    return problems


def _tensors(out):
    return vars(out) if dataclasses.is_dataclass(out) else out


made_initial: dict[int, dict] = {}


def all_cases(rank, world, models):
    report = {}
    made = {name: make(name) for name in models}
    for net, *_ in made.values():
        made_initial[id(net)] = copy.deepcopy(net.state_dict())
    combos = itertools.product(models, ["gpipe", "1f1b"], [1, 3, 8])
    for i, (name, schedule, m) in enumerate(combos):
        opt_kind = "sgd" if i % 2 == 0 else "adam"
        report[(name, schedule, m, opt_kind)] = check_case(rank, world, name, schedule, m, opt_kind,
                                                           check_outputs=m == 3, made=made[name])
    return report


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.timeout(600)
def test_pipeline_equals_single_process(world):
    results = run_ranks(world, all_cases, MODELS, timeout=580)
    failures = {
        f"rank {r} {case}": problems
        for r, report in enumerate(results)
        for case, problems in report.items()
        if problems
    }
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    assert len(results[0]) == len(MODELS) * 6


# Schedules beyond 1F1B, and recomputation: micro-batch counts that do not divide by the
# number of stages (3, 5), and the interleaved schedule with two chunks per rank.
MORE_SCHEDULES = [
    ("zbh1", 3, {}),
    ("zbh1", 5, {"recompute": True}),
    ("interleaved", 3, {"num_virtual_stages": 2}),
    ("interleaved", 5, {"num_virtual_stages": 2, "recompute": "auto"}),
    ("1f1b", 5, {"recompute": True}),
    ("gpipe", 3, {"recompute": [0]}),
    # linear weight gradients once per step over all micro-batches
    ("gpipe", 5, {"batch_weight_grads": True}),
    ("1f1b", 3, {"batch_weight_grads": True, "recompute": [0]}),
    ("zbh1", 5, {"batch_weight_grads": True}),
    ("interleaved", 5, {"num_virtual_stages": 2, "batch_weight_grads": True}),
]


def more_cases(rank, world, models):
    report = {}
    made = {name: make(name) for name in models}
    for net, *_ in made.values():
        made_initial[id(net)] = copy.deepcopy(net.state_dict())
    for i, (name, (schedule, m, config)) in enumerate(itertools.product(models, MORE_SCHEDULES)):
        if LAYERS[name] < world * config.get("num_virtual_stages", 1):
            continue  # fewer layers than stages
        opt_kind = "sgd" if i % 2 == 0 else "adam"
        fresh = make(name) if config.get("num_virtual_stages", 1) > 1 else made[name]
        if fresh is not made[name]:  # another split of the same module: capture it anew
            made_initial[id(fresh[0])] = copy.deepcopy(fresh[0].state_dict())
        report[(name, schedule, m, str(config))] = check_case(
            rank, world, name, schedule, m, opt_kind, check_outputs=m == 3, made=fresh, **config)
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.timeout(900)
def test_more_schedules_equal_single_process(world):
    results = run_ranks(world, more_cases, MODELS, timeout=880)
    failures = {
        f"rank {r} {case}": problems
        for r, report in enumerate(results)
        for case, problems in report.items()
        if problems
    }
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    interleaved = sum(1 for *_, c in MORE_SCHEDULES if c.get("num_virtual_stages", 1) > 1)
    too_small = sum(1 for name in MODELS if LAYERS[name] < 2 * world)
    assert len(results[0]) == len(MODELS) * len(MORE_SCHEDULES) - too_small * interleaved
