"""Training each Hugging Face architecture with plait and in one process, and what differs.

Each architecture (`tests/architectures.py`) trains 3 SGD steps with momentum (batches of 6, 6
and 4 rows) with plait and, on the side, a deep copy in one process. Compared: each step's
loss, the full `state_dict` after the steps (atol 2e-5: sums over micro-batches in another order)
and `predict`'s logits. A run is a `Config`'s fields: the path users take (`num_stages=2`, the
planner cutting), or a pinned cut (`layers_per_stage`) to reproduce a failure.

Run as a module, it trains a list of architectures on N local ranks and writes the report as JSON,
so the suite can run it under another transformers release (`tests/test_architectures.py`):

    python -m tests.architecture_runs --ranks 2 --fields '{"num_stages": 2}' --out report.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

import torch

import plait
from plait.capture.layers import LayerAssignment
from plait.capture.trace import capture_batch

__all__ = ["BATCHES", "MICROBATCHES", "every_layer", "valid_cut", "train_and_compare", "train_all", "main"]

BATCHES = (6, 6, 4)  # rows of the three steps: micro-batches of 2/2/2, then 2/1/1
MICROBATCHES = 3
EVERY_LAYER = "every layer"  # fields value: a chunk after every cuttable boundary, on 2 ranks


def valid_cut(layers: LayerAssignment, parts: int) -> tuple[int, ...]:
    """The even cut of the layers into `parts` stages, each boundary moved past any uncuttable
    region it falls into: a pinned cut (`layers_per_stage`) to reproduce a failure."""
    from tests.models import even_cut

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


def every_layer(layers: LayerAssignment, num_stages: int) -> tuple[int, ...]:
    """Layers per chunk, a chunk boundary after every layer where a cut may fall (an uncuttable
    region stays one chunk); the last chunks merged until their count divides by `num_stages`."""
    chunks, size = [], 0
    for i in range(len(layers.layer_names)):
        size += 1
        if i == len(layers.layer_names) - 1 or layers.valid_cut(i):
            chunks.append(size)
            size = 0
    while len(chunks) % num_stages:
        chunks[-2:] = [chunks[-2] + chunks[-1]]
    return tuple(chunks)


def _rows(x: Any, a: int, b: int) -> Any:
    return {k: v[a:b] for k, v in x.items()}


def _config(arch: Any, fields: dict[str, Any], leaf_modules: tuple[str, ...]) -> plait.Config:
    """The run's Config: its fields, and for EVERY_LAYER the interleaved chunks of `every_layer`."""
    if fields.get("layers_per_stage") == EVERY_LAYER:
        num_stages = fields.get("num_stages", 2)
        chunks = every_layer(capture_batch(arch.net, arch.x, keep=leaf_modules).layers, num_stages)
        fields = {**fields, "layers_per_stage": chunks, "num_virtual_stages": len(chunks) // num_stages,
                  "schedule": "interleaved" if len(chunks) > num_stages else "1f1b"}
    fields = {"num_microbatches": MICROBATCHES, "timeout_s": 60.0, **fields}
    return plait.Config(leaf_modules=leaf_modules, **fields)


def train_and_compare(name: str, fields: dict[str, Any], leaf_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train `name` with plait (`Config(**fields)`) and in one process; what differs, and the plan."""
    from tests.architectures import make

    arch = make(name)
    ref = copy.deepcopy(arch.net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = plait.Model(arch.net, config=_config(arch, fields, leaf_modules), loss=arch.loss,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    problems, a = [], 0
    for rows in BATCHES:
        xb, yb = _rows(arch.x, a, a + rows), arch.y[a:a + rows]
        got = model.train_on_batch(xb, yb)
        ref_opt.zero_grad(set_to_none=True)
        loss = arch.loss(ref(**xb), yb)
        loss.backward()
        ref_opt.step()
        if abs(got - loss.item()) > 1e-5 * abs(loss.item()) + 1e-6:
            problems.append(f"loss of rows {a}:{a + rows}: {got} != {loss.item()}")
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
        want_logits = arch.logits(ref(**arch.x))
    try:
        got_logits = arch.logits(model.predict(arch.x, batch_size=BATCHES[0]))
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=2e-5)
    except (AssertionError, AttributeError) as e:
        problems.append(f"predict: {str(e).splitlines()[0]}")
    plan = model.plan
    return {"problems": problems, "capture_method": plan.capture_method, "cut": list(plan.layers_per_stage),
            "num_stages": plan.num_stages, "dp": plan.dp, "tp": plan.tp, "kept_whole": list(plan.kept_whole),
            "num_chunks": plan.num_chunks}


def train_all(rank: int, world: int, names: list[str], fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every architecture in turn on this job; a failure is recorded and the next one runs."""
    report = {}
    for name in names:
        try:
            report[name] = train_and_compare(name, fields)
        except Exception as e:  # noqa: BLE001 - reported per architecture
            report[name] = {"problems": [f"{type(e).__name__}: {str(e)[:2000]}"], "capture_method": None}
    return report


def main(argv: list[str] | None = None) -> int:
    """Train architectures on local ranks; write every rank's report and the transformers version."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--fields", default='{"num_stages": 2}', help="Config fields as JSON")
    parser.add_argument("--names", nargs="*", help="architectures (default: all)")
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import transformers

    from tests.architectures import ARCHITECTURES
    from tests.harness import run_ranks

    names = args.names or ARCHITECTURES
    report = run_ranks(args.ranks, train_all, names, json.loads(args.fields), timeout=args.timeout)
    with open(args.out, "w") as f:
        json.dump({"transformers": transformers.__version__, "ranks": report}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
