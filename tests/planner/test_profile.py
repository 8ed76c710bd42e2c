"""The profiler on the demo's real CNN: plausible numbers, bytes that match the split, a model
left as it was, and the in-memory and on-disk caches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait.planner.profile as profiling
from plait.capture.split import split
from plait.capture.trace import capture
from plait.cli.demo import PaperCNN
from plait.planner.layer_runs import LayerRuns
from plait.planner.profile import ProfileOptions, profile


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    net = PaperCNN(in_hw=16)  # conv 32 @14x14, conv 64 @12x12, pool -> 6x6, dense 2304 -> 128 -> 10
    x = torch.randn(32, 1, 16, 16)
    return net, x, profile(net, (x,), options=ProfileOptions(repeats=3, threads=1))


@pytest.mark.timeout(120)
def test_numbers_are_plausible(cnn):
    net, x, prof = cnn
    costs = prof.costs
    assert costs.names == tuple(str(i) for i in range(11))  # the Sequential's 11 leaves
    conv1, conv2, dense1, dense2 = 0, 2, 7, 10
    for i in (conv1, conv2, dense1, dense2):
        assert costs.forward(32)[i] > 0 and costs.backward(32)[i] + costs.weight(32)[i] > 0
    assert costs.forward(32)[conv2] > costs.forward(32)[dense2]  # 2.4 MFLOP a row vs 1.3 k
    # the conv layers' feature maps dwarf the dense layers' vectors, saved and sent
    assert min(costs.output_row_bytes[conv1], costs.output_row_bytes[conv2]) > 10 * costs.output_row_bytes[dense1]
    assert costs.activation_row_bytes[conv2] > 10 * costs.activation_row_bytes[dense2]
    assert costs.output_row_bytes[conv1] == 32 * 14 * 14 * 4  # fp32 (B, 32, 14, 14), per row
    assert costs.input_row_bytes == 16 * 16 * 4
    # parameter bytes: conv2 = 32*64*9 + 64 floats; grads the same (all trainable)
    assert costs.param_bytes[conv2] == (32 * 64 * 9 + 64) * 4 == costs.grad_bytes[conv2]
    assert sum(costs.param_bytes) == sum(p.numel() * 4 for p in net.parameters())
    assert costs.optimizer_s[dense1] > 0 and costs.optimizer_s[1] == 0  # ReLU has nothing to step
    assert costs.weight_row_s[1] == 0 and costs.backward(32)[0] == 0  # the input needs no grad
    assert 0 < prof.seconds < 60 and not prof.cached


def test_cut_bytes_are_what_split_sends(cnn):
    net, x, prof = cnn
    captured = capture(net, (x[:2],), {})
    for cut in (1, 4, 7):
        stages = split(captured, [0] * (cut + 1) + [1] * (11 - cut - 1))
        with torch.no_grad():
            sent = stages[0].module(x)
        assert sum(t.numel() * t.element_size() for t in sent) / 32 == prof.costs.output_row_bytes[cut]


def test_second_call_is_cached_in_memory_and_on_disk(cnn, tmp_path):
    net, x, prof = cnn
    again = profile(net, (x,), options=ProfileOptions(repeats=3, threads=1))
    assert again.cached and again.costs == prof.costs
    other_batch = profile(net, (x[:16],), options=ProfileOptions(repeats=3, threads=1, cache_dir=tmp_path))
    assert not other_batch.cached and other_batch.signature != prof.signature
    profiling._CACHE.pop(other_batch.signature)
    from_disk = profile(net, (x[:16],), options=ProfileOptions(repeats=3, threads=1, cache_dir=tmp_path))
    assert from_disk.cached and from_disk.costs == other_batch.costs
    assert len(list(tmp_path.glob("profile-*.json"))) == 1


def test_reuse_false_measures_again_and_caches_the_new_profile(cnn, tmp_path):
    net, x, _ = cnn
    first = profile(net, (x[:8],), options=ProfileOptions(repeats=1, threads=1, cache_dir=tmp_path))
    again = profile(net, (x[:8],), options=ProfileOptions(repeats=1, threads=1, cache_dir=tmp_path, reuse=False))
    assert not again.cached and again.signature == first.signature
    assert profile(net, (x[:8],), options=ProfileOptions(repeats=1, threads=1)).costs == again.costs  # the new one is kept


class Normed(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))


def test_model_left_as_it_was_and_loss_included():
    torch.manual_seed(1)
    net = Normed().eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    torch.manual_seed(7)
    prof = profile(net, (x,), options=ProfileOptions(loss=nn.CrossEntropyLoss(), target=y, repeats=2))
    after_profile = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), after_profile)  # the profile consumed no random numbers
    assert not net.training
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN statistics restored
    assert prof.costs.num_layers == 5 and prof.costs.backward(16)[-1] > 0
    assert prof.costs.param_bytes[1] == (8 + 8 + 8 + 8) * 4 + 8  # weight, bias, mean, var, count
    assert prof.costs.grad_bytes[1] == 16 * 4


def test_bad_repeats():
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        ProfileOptions(repeats=0)


@pytest.mark.timeout(120)
def test_layer_times_sum_to_the_whole_model_pass(monkeypatch):
    # Each round's layer times are scaled so that their sums at the profiled rows are that
    # round's forward and backward of one pass through the whole model (layers timed alone run
    # from cache). Here the whole forward is made twice the round's layer F, the backward three
    # times its B + W: the profile must report those sums, and the rounds' median.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(61, 37), nn.ReLU(), nn.Linear(37, 5))  # a signature of its own: not cached
    x = torch.randn(16, 61)
    last: dict[int, tuple[float, float]] = {}
    real_sample_layers = LayerRuns.sample_layers

    def sample_layers(self):
        layers = real_sample_layers(self)
        for t in layers:  # equal rounds, so the median is exactly this round's sums
            t.update(f=1e-3, b=2e-3, w=3e-3)
        last[self.rows] = (sum(t["f"] for t in layers), sum(t["b"] + t["w"] for t in layers))
        return layers

    def whole(self):
        f, bw = last[self.rows]
        return 2 * f, 3 * bw

    monkeypatch.setattr(LayerRuns, "sample_layers", sample_layers)
    monkeypatch.setattr(LayerRuns, "whole", whole)
    costs = profile(net, (x,), options=ProfileOptions(repeats=3, threads=1)).costs
    assert sum(costs.forward(16)) == pytest.approx(2 * last[16][0], rel=1e-6)
    assert sum(costs.backward(16)) + sum(costs.weight(16)) == pytest.approx(3 * last[16][1], rel=1e-6)
    assert "x 2.00 / 2.00 (forward), x 3.00 / 3.00 (backward)" in costs.source


def test_a_layer_is_the_median_of_rounds_each_scaled_to_its_own_whole_pass(monkeypatch):
    # A host that runs twice as slow in one round: that round's layers and whole pass both
    # double, its scaled times are the same as the other rounds', and the result does not move.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 2))
    x = torch.randn(8, 13)
    speed = iter([1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0])  # warm-up, then the rounds (x rows)
    now = {"speed": 1.0}

    def sample_layers(self):
        now["speed"] = next(speed)
        return [{"f": now["speed"] * 1e-3, "b": now["speed"] * 2e-3, "w": 0.0} for _ in self.stages]

    def whole(self):
        n = len(self.stages)
        return now["speed"] * n * 1.5e-3, now["speed"] * n * 2e-3

    monkeypatch.setattr(LayerRuns, "sample_layers", sample_layers)
    monkeypatch.setattr(LayerRuns, "whole", whole)
    costs = profile(net, (x,), options=ProfileOptions(repeats=3, threads=1)).costs
    assert costs.forward(8) == pytest.approx([1.5e-3] * costs.num_layers, rel=1e-6)
    assert costs.backward(8) == pytest.approx([2e-3] * costs.num_layers, rel=1e-6)


def test_with_slowest_each_round_takes_the_slowest_ranks_whole_pass(monkeypatch):
    # Planning profiles on every rank at once; `slowest` reduces each round's whole-model times
    # over the ranks (a step waits for its slowest rank). Here the other rank is 1.5 x slower:
    # the layers' sums must come out 1.5 x this process's whole pass, and the reduction must be
    # called once to decide the cache, then once per round of each of the two row counts.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(29, 31), nn.ReLU(), nn.Linear(31, 3))  # a signature of its own
    x = torch.randn(16, 29)
    calls: list[list[float]] = []

    def sample_layers(self):
        return [{"f": 1e-3, "b": 2e-3, "w": 1e-3} for _ in self.stages]

    def whole(self):
        return 4e-3 * len(self.stages), 5e-3 * len(self.stages)

    def slowest(values):
        calls.append(list(values))
        return [1.5 * v for v in values] if len(values) == 2 else list(values)

    monkeypatch.setattr(LayerRuns, "sample_layers", sample_layers)
    monkeypatch.setattr(LayerRuns, "whole", whole)
    costs = profile(net, (x,), options=ProfileOptions(repeats=3, threads=1, slowest=slowest)).costs
    n = costs.num_layers
    assert sum(costs.forward(16)) == pytest.approx(1.5 * 4e-3 * n, rel=1e-6)
    assert sum(costs.backward(16)) + sum(costs.weight(16)) == pytest.approx(1.5 * 5e-3 * n, rel=1e-6)
    assert calls[0] == [1.0]  # no rank has it cached here: everyone measures
    assert len(calls) == 1 + 2 * 3 and all(len(c) == 2 for c in calls[1:])
    assert "(the slowest rank's)" in costs.source
    alone = profile(net, (x,), options=ProfileOptions(repeats=3, threads=1)).costs  # its own signature: measured alone
    assert sum(alone.forward(16)) == pytest.approx(4e-3 * n, rel=1e-6)


def test_with_slowest_a_cached_profile_is_used_only_when_every_rank_has_one():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(23, 19), nn.ReLU(), nn.Linear(19, 2))
    x = torch.randn(8, 23)
    alone = lambda values: list(values)  # noqa: E731 - one rank: the values as they are
    first = profile(net, (x,), options=ProfileOptions(repeats=1, threads=1, slowest=alone))
    assert not first.cached
    assert profile(net, (x,), options=ProfileOptions(repeats=1, threads=1, slowest=alone)).cached
    decided: list[list[float]] = []

    def another_rank_lacks_it(values):
        decided.append(list(values))
        return [1.0] if len(values) == 1 else list(values)

    again = profile(net, (x,), options=ProfileOptions(repeats=1, threads=1, slowest=another_rank_lacks_it))
    assert decided[0] == [0.0]  # this rank had it...
    assert not again.cached  # ...another did not: this rank measured beside it, as it must


def profile_with_one_rank_cached(rank, world):
    import torch.distributed as dist

    from plait.runtime.comm.collectives import max_floats

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(17, 13), nn.ReLU(), nn.Linear(13, 2))
        x = torch.randn(8, 17)
        if rank == 0:  # only rank 0 has this profile cached
            profile(net, (x,), options=ProfileOptions(repeats=1, threads=1, slowest=lambda values: list(values)))
        both = profile(net, (x,), options=ProfileOptions(repeats=1, threads=1, slowest=max_floats))
        return both.cached
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_ranks_with_and_without_a_cached_profile_all_measure_and_none_waits():
    from tests.harness import run_ranks

    # Had rank 0 returned its cached profile, rank 1 would wait for it in the first round's
    # all-reduce until the harness timed out.
    assert run_ranks(2, profile_with_one_rank_cached, timeout=80) == [False, False]


class _FixedStep:
    """An optimizer whose step takes 2 ms whatever it steps: what a stage's step pays once."""

    def __init__(self, params):
        self.params = list(params)

    def step(self):
        import time

        time.sleep(2e-3)


@pytest.mark.timeout(60)
def test_layers_optimizer_steps_are_scaled_to_one_step_over_them_all(monkeypatch):
    layers = [[nn.Parameter(torch.zeros(256))] for _ in range(4)] + [[]]
    alone = [profiling._optimizer_time(ps, _FixedStep, 3) for ps in layers]
    assert sum(alone) > 4 * 1.9e-3  # four steps of 2 ms, timed layer by layer
    scaled = profiling._optimizer_times(layers, _FixedStep, 3)
    assert scaled[4] == 0 and 1.5e-3 < sum(scaled) < 0.75 * sum(alone)  # one step for the four
    assert scaled[0] == pytest.approx(scaled[1], rel=0.5)  # their shares kept
    # past WHOLE_STEP_BYTES only the first layers are stepped together; one alone: no scale
    monkeypatch.setattr(profiling, "WHOLE_STEP_BYTES", 256 * 4)
    assert sum(profiling._optimizer_times(layers, _FixedStep, 3)) > 4 * 1.9e-3
