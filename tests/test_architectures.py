"""Every common Hugging Face architecture splits and trains equal to one process.

Each architecture (`tests/architectures.py`: decoder-only LMs, masked LMs, encoder-decoders, a
vision transformer, a mixture of experts; tiny random configs, nothing downloaded) trains 3 SGD
steps with momentum (batches of 6, 6 and 4 rows in 3 micro-batches, 1F1B) with plait and, on the
side, a deep copy in one process. Compared: each step's loss, the full `state_dict` after the
steps (atol 2e-5: sums over micro-batches in another order) and `predict`'s logits. The cut is
the even one over the captured layers (moved past an uncuttable region if it falls inside one),
so a failure reproduces. docs/architectures.md holds the table these tests back. In one process,
each also trains recomputed layer by layer, bit for bit as with its activations kept.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import plait
from plait.capture.layers import LayerAssignment
from plait.capture.trace import capture_batch
from tests.harness import run_ranks
from tests.models import even_cut

pytest.importorskip("transformers")
from tests.architectures import ARCHITECTURES, make  # noqa: E402 - after the importorskip

BATCHES = (6, 6, 4)  # rows of the three steps: micro-batches of 2/2/2, then 2/1/1
MICROBATCHES = 3
THREE_STAGES = ["gpt2", "llama", "bert", "t5"]
TWO_BY_TWO = ["gpt2", "albert", "bart"]


def valid_cut(layers: LayerAssignment, parts: int) -> tuple[int, ...]:
    """The even cut of the layers into `parts` stages, each boundary moved past any uncuttable
    region it falls into."""
    sizes = even_cut(len(layers.layer_names), parts)
    bounds, total = [], 0
    for size in sizes[:-1]:
        total += size
        after = total - 1
        region = layers.region_of(after)
        if region is not None:
            after = region[1]
        bounds.append(max(after + 1, bounds[-1] + 1 if bounds else 1))
    edges = [0, *bounds, len(layers.layer_names)]
    cut = tuple(b - a for a, b in zip(edges, edges[1:]))
    assert all(n > 0 for n in cut), f"no valid cut of {len(layers.layer_names)} layers into {parts}: {cut}"
    return cut


def _rows(x: Any, a: int, b: int) -> Any:
    return {k: v[a:b] for k, v in x.items()}


def train_and_compare(name: str, num_stages: int, dp: int, leaf_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train `name` with plait (num_stages x world / num_stages) and in one process; what differs."""
    arch = make(name)
    ref = copy.deepcopy(arch.net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cut = valid_cut(capture_batch(arch.net, arch.x, keep=leaf_modules).layers, num_stages)
    config = plait.Config(layers_per_proc=cut, dp=dp, num_microbatches=MICROBATCHES, schedule="1f1b",
                          timeout_s=60.0, leaf_modules=leaf_modules)
    model = plait.Model(arch.net, config=config, loss=arch.loss,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    problems, a = [], 0
    for rows in BATCHES:
        xb, yb = _rows(arch.x, a, a + rows), arch.y[a:a + rows]
        got = model.train_on_batch(xb, yb)
        ref_opt.zero_grad(set_to_none=True)
        loss = arch.loss(ref(**xb), yb)
        loss.backward()
        ref_opt.step()
        if abs(got - float(loss)) > 1e-5 * abs(float(loss)) + 1e-6:
            problems.append(f"loss of rows {a}:{a + rows}: {got} != {float(loss)}")
        a += rows
    state, want = model.state_dict(), ref.state_dict()
    if sorted(state) != sorted(want):
        problems.append(f"state_dict keys differ: only plait {sorted(set(state) - set(want))}, "
                        f"only one process {sorted(set(want) - set(state))}")
    for key in sorted(set(state) & set(want)):
        try:
            torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=2e-5)
        except AssertionError as e:
            problems.append(f"state {key}: {str(e).splitlines()[0]}")
    ref.eval()
    with torch.no_grad():
        want_logits = ref(**arch.x).logits
    try:
        got_logits = model.predict(arch.x, batch_size=BATCHES[0]).logits
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=2e-5)
    except (AssertionError, AttributeError) as e:
        problems.append(f"predict: {str(e).splitlines()[0]}")
    plan = model.plan
    return {"problems": problems, "capture_method": plan.capture_method, "cut": list(cut),
            "num_stages": plan.num_stages, "dp": plan.dp, "kept_whole": plan.kept_whole}


def train_all(rank: int, world: int, names: list[str], num_stages: int) -> dict[str, dict[str, Any]]:
    """Every architecture in turn on this job; a failure is recorded and the next one runs."""
    report = {}
    for name in names:
        try:
            report[name] = train_and_compare(name, num_stages, world // num_stages)
        except Exception as e:  # noqa: BLE001 - reported per architecture
            report[name] = {"problems": [f"{type(e).__name__}: {str(e)[:2000]}"], "capture_method": None}
    return report


def check(report: list[dict[str, Any]], name: str, num_stages: int, dp: int) -> None:
    problems = [f"rank {r}: {p}" for r, ranks in enumerate(report) for p in ranks[name]["problems"]]
    assert not problems, f"{name}:\n" + "\n".join(problems)
    for ranks in report:
        assert (ranks[name]["num_stages"], ranks[name]["dp"]) == (num_stages, dp), ranks[name]


@pytest.fixture(scope="module")
def two_stages() -> list[dict[str, Any]]:
    """Every architecture on 2 ranks in one job: importing torch and transformers per rank costs more than a model."""
    return run_ranks(2, train_all, ARCHITECTURES, 2, timeout=900)


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.timeout(960)  # the first test also waits for the shared 2-rank run
def test_two_stages(two_stages: list[dict[str, Any]], name: str) -> None:
    check(two_stages, name, 2, 1)


def mixtral_experts_kept_whole(rank: int, world: int) -> dict[str, Any]:
    return {"mixtral": train_and_compare("mixtral", 2, 1, leaf_modules=("MixtralSparseMoeBlock",))}


@pytest.mark.timeout(300)
def test_mixtral_with_its_experts_kept_whole_by_class_name() -> None:
    report = run_ranks(2, mixtral_experts_kept_whole, timeout=280)
    check(report, "mixtral", 2, 1)
    assert report[0]["mixtral"]["kept_whole"] == ("model.layers.0.mlp", "model.layers.1.mlp")


@pytest.mark.timeout(600)
def test_three_stages() -> None:
    report = run_ranks(3, train_all, THREE_STAGES, 3, timeout=560)
    for name in THREE_STAGES:
        check(report, name, 3, 1)


@pytest.mark.timeout(600)
def test_two_stages_two_replicas() -> None:
    report = run_ranks(4, train_all, TWO_BY_TWO, 2, timeout=560)
    for name in TWO_BY_TWO:
        check(report, name, 2, 2)


def _sgd_twice(name: str, **recompute: Any) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    arch = make(name)
    model = plait.Model(arch.net, plait.Config(num_microbatches=2, schedule="gpipe", **recompute),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), loss=arch.loss)
    for _ in range(2):
        model.train_on_batch(arch.x, arch.y)
    return model.state_dict(), model.plan.recompute_by_layer


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.timeout(120)
def test_recomputed_layer_by_layer_trains_as_kept(name: str) -> None:
    """One process: each architecture's stage graph cut into its blocks' pieces, each recomputed
    in the backward, trains bit for bit as with every activation kept."""
    kept, _ = _sgd_twice(name)
    again, by_layer = _sgd_twice(name, recompute=True, recompute_by_layer=True)
    assert by_layer == (0,)
    for key, value in kept.items():
        assert torch.equal(again[key], value), key

