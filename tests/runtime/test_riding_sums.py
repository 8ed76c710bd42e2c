"""The step's sums ride on the pipeline's messages: every rank reads the all-reduce's total.

The pure tests drive `RidingSums` through every schedule's program as the interpreter does, one
process standing in for all ranks (a receive runs once its send has); the distributed tests run
pipelines of one rank per stage and check that no all-reduce is left in a step, and that the
non-finite verdict still names the right stage on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.runtime.riding_sums import RidingSums, carriers
from plait.schedule import Op, generate
from tests.harness import run_ranks
from tests.models import mlp

LENGTH = 6


def _own(stage_index: int) -> list[float]:
    """Stage s puts 2^s at entry s % LENGTH: a total that shows which stages were added, and how often."""
    vector = [0.0] * LENGTH
    vector[stage_index % LENGTH] = float(2 ** stage_index)
    return vector


def _drive(program, num_chunks: int, stage_to_rank: dict[int, int]) -> dict[int, list[float]]:
    """Each rank's total after running `program` with the sums riding, in an order a real run
    could take: every rank in program order, a receive only after its send."""
    carried = carriers(program)
    sums = {r: RidingSums(carried, num_chunks, LENGTH, _own, torch.device("cpu")) for r in program}
    wire: dict[tuple[str, int, int], torch.Tensor | None] = {}  # (direction, sender, mb) -> rider
    at = dict.fromkeys(program, 0)
    while any(at[r] < len(program[r]) for r in program):
        moved = False
        for r, actions in program.items():
            while at[r] < len(actions):
                a = actions[at[r]]
                s, k, rs = a.stage_index, a.microbatch_index, sums[r]
                if a.op is Op.RECV_F:
                    if ("F", s - 1, k) not in wire:
                        break
                    rider = wire.pop(("F", s - 1, k))
                    assert (rider is not None) == rs.rides_forward(s - 1, k)
                    if rider is not None:
                        rs.incoming_forward(s, rider)
                elif a.op is Op.RECV_B:
                    if ("B", s + 1, k) not in wire:
                        break
                    rider = wire.pop(("B", s + 1, k))
                    assert (rider is not None) == rs.rides_backward(s + 1, k)
                    if rider is not None:
                        rs.incoming_backward(rider)
                elif a.op is Op.FORWARD:
                    rs.forward_done(s, k)
                elif a.op is Op.SEND_F:
                    wire[("F", s, k)] = rs.outgoing_forward(s) if rs.rides_forward(s, k) else None
                elif a.op is Op.SEND_B:
                    wire[("B", s, k)] = rs.outgoing_backward() if rs.rides_backward(s, k) else None
                at[r] += 1
                moved = True
        assert moved, "the program deadlocked"
    return {r: rs.result() for r, rs in sums.items()}


@pytest.mark.parametrize("schedule, ranks, virtual, m", [
    ("gpipe", 2, 1, 4), ("1f1b", 4, 1, 3), ("1f1b", 3, 1, 7), ("zbh1", 4, 1, 5), ("zbh1", 2, 1, 1),
    ("interleaved", 2, 2, 4), ("interleaved", 3, 2, 5), ("interleaved", 2, 3, 2),
])
def test_every_rank_reads_the_sum_of_every_stage_once(schedule, ranks, virtual, m):
    num_chunks = ranks * virtual
    stage_to_rank = {s: s % ranks for s in range(num_chunks)}
    program = generate(schedule, num_chunks, m, stage_to_rank=stage_to_rank, num_virtual_stages=virtual)
    want = [0.0] * LENGTH
    for s in range(num_chunks):
        want = [a + b for a, b in zip(want, _own(s))]
    totals = _drive(program, num_chunks, stage_to_rank)
    assert set(totals) == set(range(ranks))
    assert all(total == want for total in totals.values()), totals


def test_the_last_stage_never_rides_forward_and_the_first_never_back():
    program = generate("1f1b", 3, 4)
    rs = RidingSums(carriers(program), 3, LENGTH, _own, torch.device("cpu"))
    assert carriers(program) == ({0: 3, 1: 3, 2: 3}, {0: 3, 1: 3, 2: 3})
    assert [rs.rides_forward(s, 3) for s in range(3)] == [True, True, False]
    assert [rs.rides_backward(s, 3) for s in range(3)] == [False, True, True]
    assert not rs.rides_forward(0, 2) and not rs.rides_backward(2, 2)  # other micro-batches: bare


def _count_all_reduces(log: list[str]) -> None:
    import torch.distributed as dist

    original = dist.all_reduce

    def counted(*args, **kwargs):
        log.append("all_reduce")
        return original(*args, **kwargs)

    dist.all_reduce = counted


def train(rank, world, config_kwargs, data, net_fn=mlp):
    torch.manual_seed(0)
    net = net_fn()
    initial = copy.deepcopy(net.state_dict())
    model = plait.Model(net, plait.Config(**config_kwargs), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss())
    model.build(data[0][0])
    calls: list[str] = []
    _count_all_reduces(calls)
    losses, counts, error = [], [], None
    try:
        for x, y in data:
            before = len(calls)
            losses.append(model.train_on_batch(x, y))
            counts.append(len(calls) - before)
    except plait.NonFiniteError as e:
        error = str(e)
    return losses, counts, error, model.state_dict(), model.step, initial


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _reference(initial, data, net_fn=mlp):
    net = net_fn()
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, net.state_dict()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("config", [
    dict(layers_per_stage=(5, 6), num_microbatches=2, schedule="zbh1"),
    dict(layers_per_stage=(3, 3, 2, 3), num_stages=2, num_microbatches=4, schedule="interleaved",
         num_virtual_stages=2),
], ids=["zbh1", "interleaved"])
def test_a_pipeline_of_one_rank_per_stage_steps_without_an_all_reduce_and_equals_one_process(config):
    data = _batches()
    for losses, counts, error, state, step, initial in run_ranks(2, train, config, data, timeout=140):
        assert error is None and step == 3
        assert counts == [0, 0, 0]  # the sums rode on the pipeline's messages
        want_losses, want_state = _reference(initial, data)
        assert losses == pytest.approx(want_losses, rel=1e-6)
        for k in want_state:
            torch.testing.assert_close(state[k], want_state[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(150)
def test_with_replicas_the_sums_still_take_the_all_reduce():
    data = _batches()
    config = dict(layers_per_stage=(11,), num_microbatches=2, dp=2)
    for losses, counts, error, _, _, _ in run_ranks(2, train, config, data, timeout=140):
        assert error is None and all(c >= 1 for c in counts), counts


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


def exp_net() -> nn.Module:
    """Linear | Linear | Exp | Linear: a huge input stays finite until stage 2 overflows it."""
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), Exp(), nn.Linear(16, 4))


@pytest.mark.timeout(150)
def test_an_overflow_in_the_third_of_four_interleaved_stages_is_named_on_both_ranks():
    # Stage 2 (rank 0's second chunk) is the first to make an infinity: its flag rode to rank 1 on
    # stage 2's last activations, and the verdict came back to rank 0 on stage 3's last gradients.
    data = [(x * 0.1, y) for x, y in _batches()]
    data[1][0][1, 2] = 1e4
    config = dict(layers_per_stage=(1, 1, 1, 1), num_stages=2, num_microbatches=4, schedule="interleaved",
                  num_virtual_stages=2)
    for losses, counts, error, state, step, initial in run_ranks(2, train, config, data, exp_net, timeout=140):
        assert step == 1 and counts == [0]
        assert error.startswith("step 2: a NaN or infinite value first appeared in the output of stage 2 (rank 0)"), error
        _, want_state = _reference(initial, data[:1], exp_net)
        for k in want_state:
            torch.testing.assert_close(state[k], want_state[k], rtol=1e-5, atol=1e-6, msg=k)


def fit_with_accuracy(rank, world, data):
    torch.manual_seed(0)
    net = mlp()
    initial = copy.deepcopy(net.state_dict())
    config = plait.Config(layers_per_stage=(5, 6), num_microbatches=2, schedule="1f1b", on_nonfinite="ignore")
    model = plait.Model(net, config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss(), metrics=["accuracy"])
    x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    history = model.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    return history.history, model._train.rides, initial


@pytest.mark.timeout(150)
def test_the_metric_sums_ride_too_without_the_non_finite_flags():
    # on_nonfinite="ignore": the vector holds the loss and accuracy sums alone.
    data = _batches()
    for history, rode, initial in run_ranks(2, fit_with_accuracy, data, timeout=140):
        assert rode
        net = mlp()
        net.load_state_dict(initial)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loss_sum, correct = 0.0, 0
        for x, y in data:
            opt.zero_grad()
            out = net(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)
            correct += int((out.argmax(-1) == y).sum())
        assert history["loss"] == [pytest.approx(loss_sum / 24, rel=1e-6)]
        assert history["accuracy"] == [pytest.approx(correct / 24)]
