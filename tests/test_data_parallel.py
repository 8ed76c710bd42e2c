"""Pipeline x data parallel equals one process: dp in {1..4} x pp in {1, 2}, uneven shards included.

Global batches of 10, 10 and 3 rows: 10 does not divide by 3 or 4, and with dp=4 the last batch
leaves one replica without rows, which must still take part in the gradient all-reduce.
Every layout gives its cut (`tests.models.even_cut`; a single stage holds every layer), so a
failure reproduces: without one the planner would profile, even for one stage.
"""

from __future__ import annotations

import copy

import pytest
import torch

import plait
from tests.harness import run_ranks
from tests.models import LAYERS, even_cut, make

BATCH = 10
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(4, 1), (2, 2)], 6: [(3, 2)], 8: [(4, 2)]}


def _call(net, x):
    return net(*x) if isinstance(x, tuple) else net(x)


def reference_fit(ref, x, y, loss_fn, epochs):
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = y.shape[0]
    for _ in range(epochs):
        for a in range(0, rows, BATCH):
            xb = tuple(t[a:a + BATCH] for t in x) if isinstance(x, tuple) else x[a:a + BATCH]
            opt.zero_grad()
            loss_fn(_call(ref, xb), y[a:a + BATCH]).backward()
            opt.step()


def compare(rank, world, name, dp, pp, made, **extra):
    net, x, y, loss_fn = made
    net.load_state_dict(made_initial[id(net)])  # one module per model, reset: one capture each
    for p in net.parameters():
        p.grad = None
    ref = copy.deepcopy(net)
    torch.manual_seed(1000 + rank)  # replicas must agree whatever their own seeds
    cut = even_cut(LAYERS[name], pp * extra.get("num_virtual_stages", 1))
    model = plait.Model(net, plait.Config(dp=dp, num_stages=pp, num_microbatches=3, bucket_cap_mb=0.01,
                                          layers_per_stage=cut, **extra),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), loss=loss_fn)
    model.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    reference_fit(ref, x, y, loss_fn, epochs=2)
    problems = []
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        try:
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"param {k}: {e}")
    ref.eval()
    with torch.no_grad():
        want = _call(ref, x)
        want_loss = float(loss_fn(want, y))
    got = model.predict(x, batch_size=7)  # 23 rows: batches of 7, 7, 7, 2 over dp replicas
    try:
        got_t = got.logits if hasattr(got, "logits") else got
        want_t = want.logits if hasattr(want, "logits") else want
        torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        problems.append(f"predict: {e}")
    result = model.evaluate(x, y, batch_size=7)
    if abs(result["loss"] - want_loss) > 1e-5 * abs(want_loss):
        problems.append(f"evaluate loss {result['loss']} != {want_loss}")
    if model.plan.dp != dp or model.plan.pp != pp:
        problems.append(f"plan has dp={model.plan.dp}, stages={model.plan.num_stages}")
    return problems


made_initial: dict[int, dict] = {}


def layouts(rank, world):
    made = {name: make(name) for name in ["mlp", "cnn", "gpt"]}
    for net, *_ in made.values():
        made_initial[id(net)] = copy.deepcopy(net.state_dict())
    return {(name, dp, pp): compare(rank, world, name, dp, pp, made[name])
            for dp, pp in LAYOUTS[world] for name in made}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.timeout(300)
def test_data_parallel_equals_one_process(world):
    results = run_ranks(world, layouts, timeout=280)
    failures = {f"rank {r} {case}": p for r, rep in enumerate(results) for case, p in rep.items() if p}
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


def sum_reduction(rank, world):
    """grad_reduction="sum": the gradient is the sum of each replica's own mean-loss gradient."""
    net, x, y, loss_fn = make("mlp")
    ref = copy.deepcopy(net)
    model = plait.Model(net, plait.Config(dp=2, layers_per_stage=(11,), num_microbatches=2, grad_reduction="sum"),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=loss_fn)
    model.train_on_batch(x[:10], y[:10])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.zero_grad()
    (loss_fn(ref(x[:5]), y[:5]) + loss_fn(ref(x[5:10]), y[5:10])).backward()
    opt.step()
    state = model.state_dict()
    return max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())


@pytest.mark.timeout(120)
def test_sum_reduction():
    assert all(diff < 1e-6 for diff in run_ranks(2, sum_reduction, timeout=110))


def test_world_size_that_is_not_dp_times_pp():
    with pytest.raises(plait.ConfigError) as info:
        plait.Config(dp=2, num_stages=3).stages_for(4)
    message = str(info.value)
    assert "3 pipeline stages x dp=2 replicas = 6 ranks" in message and "world size is 4" in message
    with pytest.raises(plait.ConfigError, match="world size 5 does not divide by dp=2"):
        plait.Config(dp=2).stages_for(5)
    assert plait.Config(dp=2).stages_for(6) == 3


def test_layout_keeps_pipeline_neighbours_adjacent():
    plan = plait.Plan(layer_names=("a", "b"), layers_per_stage=(1, 1), num_microbatches=1,
                      schedule="1f1b", world_size=6, capture_method="torch.fx", dp=3)
    assert [plan.rank_of(s, 1) for s in range(2)] == [2, 3]
    assert [plan.rank_of(0, r) for r in range(3)] == [0, 2, 4]
    assert plan.position_of(5) == (1, 2)
    assert "stage 1 (ranks 1, 3, 5)" in str(plan)


def overlap(rank, world):
    net, x, y, loss_fn = make("mlp")
    model = plait.Model(net, plait.Config(dp=2, layers_per_stage=(11,), num_microbatches=3, bucket_cap_mb=0.001),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=loss_fn)
    model.train_on_batch(x[:10], y[:10])
    sync = model._train.pipe.sync
    return len(sync.buckets), sync.launched_during_backward


@pytest.mark.timeout(120)
def test_buckets_are_launched_during_the_backward_pass():
    for buckets, early in run_ranks(2, overlap, timeout=110):
        assert buckets > 1  # a 1 KB cap puts the MLP's layers in several buckets
        assert early == buckets  # every bucket started before the step's backward finished


def other_schedules(rank, world):
    made = {name: make(name) for name in ["mlp", "gpt"]}
    for net, *_ in made.values():
        made_initial[id(net)] = copy.deepcopy(net.state_dict())
    extras = [{"schedule": "zbh1"}, {"schedule": "interleaved", "num_virtual_stages": 2},
              {"schedule": "zbh1", "recompute": True}, {"schedule": "1f1b", "batch_weight_grads": True},
              {"schedule": "zbh1", "batch_weight_grads": True}]
    return {(name, str(extra)): compare(rank, world, name, 2, 2, made[name], **extra)
            for extra in extras for name in made}


@pytest.mark.timeout(400)
def test_data_parallel_with_zero_bubble_interleaving_and_recompute():
    """Gradients accumulated in W (post-accumulate hooks fire there) and buckets over several
    stages of one rank still all-reduce to one process's result."""
    results = run_ranks(4, other_schedules, timeout=380)
    failures = {f"rank {r} {case}": p for r, rep in enumerate(results) for case, p in rep.items() if p}
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    assert len(results[0]) == 10


class _RowRecordingLoss:
    """MSE on y[:, :-1]; y's last column holds each row's id. The ids of the last call (one call
    a step with one micro-batch) are kept at the end of each step; the planner's profiling calls
    before the first step are not steps."""

    def __init__(self):
        self.last: list[int] = []
        self.seen: list[list[int]] = []

    def __call__(self, out, y):
        self.last = [int(v) for v in y[:, -1]]
        return torch.nn.functional.mse_loss(out, y[:, :-1])

    def on_batch_end(self, step, logs):
        self.seen.append(self.last)


class _Loaded(torch.utils.data.TensorDataset):
    """A TensorDataset that records the index of every row it loads."""

    def __init__(self, *tensors):
        super().__init__(*tensors)
        self.loaded: list[int] = []

    def __getitem__(self, index):
        self.loaded.append(int(index))
        return super().__getitem__(index)


def shuffled_sources(rank, world):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rows, batch = 23, 6  # 4 batches an epoch, the last of 5 rows: uneven over dp=2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 4, generator=g)
    y = torch.cat([torch.randn(rows, 3, generator=g), torch.arange(rows, dtype=torch.float32)[:, None]], 1)
    out = {}
    for kind in ("dataset", "loader"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        start = copy.deepcopy(net.state_dict())  # rank 0's parameters: every replica must start here
        if rank == 1:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)  # another seed's init: broadcast at start must undo it
        data = _Loaded(x, y)
        source = data if kind == "dataset" else DataLoader(data, batch_size=batch, shuffle=True)
        loss = _RowRecordingLoss()
        model = plait.Model(net, plait.Config(dp=2, layers_per_stage=(3,), num_microbatches=1, seed=3),
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=loss)
        model.fit(source, epochs=2, batch_size=batch, shuffle=True, verbose=0, callbacks=[loss])
        everyone = [None] * world
        dist.all_gather_object(everyone, loss.seen)  # the test's own check, not plait's wire
        out[kind] = (everyone, start, {k: v.clone() for k, v in model.state_dict().items()})
        out[f"{kind} loaded"] = data.loaded
    return out


@pytest.mark.timeout(120)
def test_shuffled_datasets_and_loaders_are_sharded_across_replicas_that_start_equal():
    # Each replica gets a distinct slice of every shuffled global batch, together they cover
    # each epoch exactly once, both replicas agree on the order, and the result equals one
    # process training on those global batches from rank 0's parameters (rank 1's were moved).
    results = run_ranks(2, shuffled_sources, timeout=110)
    rows = 23
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 4, generator=g)
    y = torch.randn(rows, 3, generator=g)
    for rank, result in enumerate(results):  # each replica loaded the first batch whole (to build on), then its own rows
        for kind in ("dataset", "loader"):
            seen = [i for step in result[kind][0][rank] for i in step]
            assert len(result[f"{kind} loaded"]) == 6 + len(seen) and result[f"{kind} loaded"][6:] == seen, (rank, kind)
    for kind, (seen, start, final) in ((k, v) for k, v in results[0].items() if not k.endswith("loaded")):
        assert len(seen[0]) == len(seen[1]) == 8, (kind, [len(s) for s in seen])  # 2 epochs x 4 batches
        epochs = []
        for step in range(8):
            a, b = seen[0][step], seen[1][step]
            assert not set(a) & set(b), (kind, step, a, b)  # distinct slices
            assert abs(len(a) - len(b)) <= 1 and len(a) + len(b) == (6 if step % 4 < 3 else 5)
            epochs.append(a + b)
        for e in range(2):
            assert sorted(i for batch in epochs[4 * e: 4 * e + 4] for i in batch) == list(range(rows)), kind
        assert epochs[:4] != epochs[4:], kind  # shuffled anew each epoch
        assert [i for batch in epochs for i in batch] != list(range(rows)) * 2, kind  # really shuffled
        ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        ref.load_state_dict(start)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for batch in epochs:
            index = torch.tensor(batch)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x[index]), y[index]).backward()
            opt.step()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6, msg=f"{kind}: {name}")
        assert all(torch.equal(final[k], results[1][kind][2][k]) for k in final), kind
