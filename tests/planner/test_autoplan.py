"""`plan_model`, the integration's entry: profile a model here, search, hand back the chosen candidate."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from plait.cli.demo import PaperCNN
from plait.job.ranks import threads_per_rank
from plait.planner.autoplan import PlanOptions, local_cluster, plan_model
from plait.planner.resolve import layout_keys
from plait.search.search import SearchSpace


@pytest.mark.timeout(120)
def test_plan_model_gives_a_config_layout_and_json():
    torch.manual_seed(0)
    net = PaperCNN(in_hw=8)
    x = torch.randn(200, 1, 8, 8)
    cluster = local_cluster(2)
    options = PlanOptions(space=SearchSpace(pp=(2,), schedules=("1f1b", "gpipe")), repeats=2,
                          loss=nn.CrossEntropyLoss(), target=torch.randint(0, 10, (200,)))
    result = plan_model(net, x, world_size=2, global_batch=200, cluster=cluster, options=options)
    best = result.best
    assert best.feasible and best.setting.pp == 2 and result.profile.rows == 64
    chosen = layout_keys(best.to_dict())  # what the run's layout takes from the planner
    assert chosen["pp"] == 2 and sum(chosen["layers_per_stage"]) == 11
    assert tuple(chosen["layers_per_stage"]) == best.layers_per_stage
    data = json.loads(result.to_json())
    assert data["pp"] == 2 and data["world_size"] == 2 and len(data["alternatives"]) >= 1
    assert "stage  0 (rank 0)" in result.table()
    again = plan_model(net, x, 2, 200, cluster, options)
    assert again.profile.cached and again.best.layers_per_stage == best.layers_per_stage


def test_local_cluster_shares_the_machine():
    one, two = local_cluster(1), local_cluster(2)
    assert two.memory_bytes == pytest.approx(one.memory_bytes / 2)
    assert threads_per_rank(1) >= threads_per_rank(2) >= 1
    # CPU ranks (gloo) sum gradients on the cores that compute: no overlap priced, and ZeRO-2's
    # sums are the all-reduces the runtime issues there
    gloo, nccl = local_cluster(2, backend="gloo"), local_cluster(2, backend="nccl")
    assert (gloo.overlap_gradients, gloo.owner_reduces) == (False, False)
    assert (nccl.overlap_gradients, nccl.owner_reduces) == (two.overlap_gradients, two.owner_reduces) == (True, True)
