"""A model torch.export cannot trace whole trains exactly: its data-dependent modules are kept whole.

`MoENet` (tests/moe.py) routes each row to one of three experts with `nonzero` and
`if rows.numel():`, so the rows per expert change from batch to batch. plait keeps both routers
whole (one opaque call each), traces the rest with torch.export, cuts between the routers, and
trains 3 SGD-with-momentum steps on 2 ranks equal to one process: losses, every parameter,
predict's outputs. The plan says what was kept whole.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import plait
from tests.alongside import state_problems, train_alongside
from tests.harness import run_ranks
from tests.moe import MoENet


def train_and_compare(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = MoENet()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(18, 6, generator=g), torch.randint(0, 3, (18,), generator=g)
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    # layers: a, moe1 | b, moe2, head
    model = plait.Model(net, plait.Config(layers_per_stage=[2, 3], num_microbatches=3, timeout_s=30.0),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss=loss_fn)
    batches = [(x[a:a + 6], y[a:a + 6]) for a in (0, 6, 12)]
    with torch.no_grad():  # rows per expert of each batch, at the initial weights
        routed = [torch.softmax(ref.moe1.gate(torch.tanh(ref.a(xb))), -1).argmax(-1).bincount(minlength=3).tolist()
                  for xb, _ in batches]
    problems = train_alongside(model, ref, ref_opt, loss_fn, batches)
    problems += state_problems(model.state_dict(), ref.state_dict())
    ref.eval()
    with torch.no_grad():
        want_out = ref(x)
    try:
        torch.testing.assert_close(model.predict(x, batch_size=6), want_out, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        problems.append(f"predict: {str(e).splitlines()[0]}")
    plan = model.plan
    return {"problems": problems, "kept_whole": plan.kept_whole, "method": plan.capture_method,
            "layers": plan.layer_names, "routed": routed, "printed": str(plan)}


@pytest.mark.timeout(200)
def test_routers_kept_whole_train_equal_to_one_process() -> None:
    for report in run_ranks(2, train_and_compare, timeout=180):
        assert not report["problems"], "\n".join(report["problems"])
        assert report["method"] == "torch.export" and report["kept_whole"] == ("moe1", "moe2")
        assert report["layers"] == ("a", "moe1", "b", "moe2", "head")
        assert "kept whole (one layer each, not traced into): moe1, moe2" in report["printed"]
        assert len({tuple(r) for r in report["routed"]}) > 1, report["routed"]  # the routing varied
