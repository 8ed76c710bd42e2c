"""Start-up without whole-model traffic: a real model whose ranks drew different values starts
consistent, each stage's tensors sent within its replica group and tied ones within their holders.

Every rank builds the tiny GPT (tied embedding and head) under its own seed. At 2 stages x 2
replicas, after the build: each rank's stage tensors equal its stage's first replica's (rank
0 or 1, whose own draws they are), the tied weight equals rank 0's everywhere, and no rank sent
or received more than its stage's bytes (the old start-up broadcast the whole model from rank 0).
Then each rank has freed the parameters its stages do not use (they are on meta), rank 0 keeping
a parameter no stage uses, and the state dict and predictions are still the whole model's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import plait
from tests.harness import run_ranks
from tests.models import LAYERS, even_cut, make


def build_with_own_seed(rank: int, world: int) -> dict[str, Any]:
    drawn = {s: dict(make("gpt", seed=s)[0].named_parameters()) for s in range(world)}  # every rank's draws
    torch.manual_seed(0)
    drawn_unused = torch.nn.Linear(3, 3).weight.detach().clone()  # rank 0's draw of the unused layer
    net, x, _, loss = make("gpt", seed=rank)
    torch.manual_seed(rank)
    net.unused = torch.nn.Linear(3, 3)  # in the state dict, used by no stage: rank 0 keeps it
    moved = [0]
    original = dist.broadcast

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        moved[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.broadcast = counting  # type: ignore[assignment]
    try:
        model = plait.Model(net, plait.Config(layers_per_stage=even_cut(LAYERS["gpt"], 2), dp=2, timeout_s=30.0),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss=loss)
        model.build(x[:4])
    finally:
        dist.broadcast = original  # type: ignore[assignment]
    pipe = model._train.pipe  # type: ignore[union-attr]
    names = {id(p): n for n, p in net.named_parameters()}
    tied = {names[id(p)] for p in pipe.ties.parameters} if pipe.ties is not None else set()
    first = pipe.plan.rank_of(pipe.plan.position_of(rank)[0], 0)
    problems = []
    for p in pipe.local_parameters:
        name = names[id(p)]
        source = 0 if name in tied else first
        if not torch.equal(p.detach(), drawn[source][name].detach()):
            problems.append(f"rank {rank}: {name} is not rank {source}'s draw")
    stage_bytes = sum(p.numel() * p.element_size() for p in pipe.local_parameters)
    whole = sum(p.numel() * p.element_size() for p in net.parameters())
    local = {id(p) for p in pipe.local_parameters}
    for name, p in net.named_parameters():
        if p.is_meta != (id(p) not in local and not (rank == 0 and name.startswith("unused."))):
            problems.append(f"rank {rank}: {name} is {'freed' if p.is_meta else 'still held'}")
    state = model.state_dict()  # gathered from the holders: every tensor real, the unused one rank 0's
    if any(v.is_meta for v in state.values()) or not torch.equal(state["unused.weight"], drawn_unused):
        problems.append(f"rank {rank}: the gathered state dict is not the whole model's")
    return {"problems": problems, "moved": moved[0], "stage_bytes": stage_bytes, "whole": whole,
            "tied": sorted(tied), "predict": model.predict(x[:3])}


@pytest.mark.timeout(200)
def test_replicas_and_tied_weights_start_equal_without_sending_the_whole_model() -> None:
    report = run_ranks(4, build_with_own_seed, timeout=180)
    for r in report:
        assert not r["problems"], "\n".join(r["problems"])
        assert r["tied"]  # the embedding and the head: held by both stages
        assert r["moved"] <= r["stage_bytes"] + 4096, r  # a few small agreements beside the stage
        assert r["stage_bytes"] < 0.8 * r["whole"]
        torch.testing.assert_close(r["predict"].logits, report[0]["predict"].logits)  # the eval pipeline runs
