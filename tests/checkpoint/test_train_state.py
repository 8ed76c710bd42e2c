"""Tests for plait.checkpoint.train_state: a rank's tensors, optimizer state and RNG states by name,
and back into a fresh model and optimizer exactly (one process, no ranks)."""

from __future__ import annotations

import copy
import json
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from plait.checkpoint import disk, train_state
from plait.errors import CheckpointError
from plait.tensor_parts import TpShard, local_part


class Tied(nn.Module):
    """emb and head share one weight; a buffer besides the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((1,), 2.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(idx)) * self.scale)


def trained(optimizer: str = "adam", steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Tied()
    make = {"adam": lambda p: torch.optim.Adam(p, lr=0.1), "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
    opt = make[optimizer](net.parameters())
    for _ in range(steps):
        opt.zero_grad()
        net(torch.tensor([[0, 1, 4]])).sum().backward()
        opt.step()
    return net, opt


# -- the model's index and owned tensors ---------------------------------------------------------


def test_model_index_names_each_tensor_once_and_the_aliases() -> None:
    net = Tied()
    owner = {id(net.mid.weight): 1, id(net.mid.bias): 1}
    keys, aliases, entries = train_state.model_index(net, owner)
    assert keys == ["scale", "emb.weight", "mid.weight", "mid.bias", "head.weight"]
    assert aliases == {"head.weight": "emb.weight"}
    assert entries == {
        "scale": {"shard": 0, "shape": [1], "dtype": "torch.float32"},  # used by no stage: rank 0 saves it
        "emb.weight": {"shard": 0, "shape": [5, 3], "dtype": "torch.float32"},
        "mid.weight": {"shard": 1, "shape": [3, 3], "dtype": "torch.float32"},
        "mid.bias": {"shard": 1, "shape": [3], "dtype": "torch.float32"},
    }
    owned = train_state.owned_tensors(net, entries, 1)
    assert list(owned) == ["mid.weight", "mid.bias"] and owned["mid.weight"] is not net.mid.weight
    assert torch.equal(owned["mid.weight"], net.mid.weight) and not owned["mid.weight"].requires_grad


def test_a_split_parameter_and_its_state_are_saved_in_parts_and_restored_whole_or_cut() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))  # 0.weight: 4 rows, 2 per tp rank
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(3, 2)).sum().backward()
        opt.step()
    whole_w, whole_avg = net[0].weight.detach().clone(), opt.state[net[0].weight]["exp_avg"].clone()

    def cut(n: nn.Module, o: torch.optim.Optimizer | None, tp_rank: int) -> None:  # as tp=2 cuts 0.weight
        p = n[0].weight
        if o is not None:
            o.state[p] = {k: local_part(v, 0, 1, tp_rank, 2) if v.dim() else v for k, v in o.state[p].items()}
        p.data = local_part(p.data, 0, 1, tp_rank, 2).clone()
        p._plait_tp = TpShard((4, 2), 0, 1, tp_rank, 2)

    shards = {}
    for r in range(2):
        n, o = copy.deepcopy((net, opt))
        cut(n, o, r)
        snap = train_state.snapshot(n, {}, r, o, {id(n[0].weight): (0, 1, [0, 1])})
        assert snap.index["tensors"]["0.weight"] == {"shard": 0, "shape": [4, 2], "dtype": "torch.float32",
                                                     "split": {"dim": 0, "blocks": 1, "shards": [0, 1]}}
        assert torch.equal(snap.tensors["0.weight"], whole_w[2 * r:2 * r + 2])
        assert ("1.weight" in snap.tensors) == (r == 0)  # a whole tensor once, by rank 0
        shards[r] = (snap.tensors, json.loads(snap.metadata["plait"])["optimizer"])
    entries = snap.index["tensors"]
    whole = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    whole_opt = torch.optim.Adam(whole.parameters(), lr=0.1)
    assert train_state.restore_optimizer(whole_opt, whole, [whole[0].weight], shards, entries) == 1
    assert torch.equal(whole_opt.state[whole[0].weight]["exp_avg"], whole_avg)  # the parts joined
    part = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    cut(part, None, 1)
    part_opt = torch.optim.Adam(part.parameters(), lr=0.1)
    assert train_state.restore_optimizer(part_opt, part, [part[0].weight], shards, entries) == 1
    assert torch.equal(part_opt.state[part[0].weight]["exp_avg"], whole_avg[2:])  # tp rank 1's part
    values = {k: v.detach() for k, v in net.state_dict().items()}
    train_state.copy_into(part, values, {}, "a state dict")
    assert torch.equal(part[0].weight.detach(), whole_w[2:])


# -- optimizer state ----------------------------------------------------------------------------


def test_optimizer_state_by_name_of_the_owned_parameters() -> None:
    net, opt = trained("sgd")
    tensors, part = train_state.optimizer_state(opt, net, ["mid.weight", "mid.bias"])
    assert sorted(tensors) == ["optimizer/mid.bias/momentum_buffer", "optimizer/mid.weight/momentum_buffer"]
    assert torch.equal(tensors["optimizer/mid.bias/momentum_buffer"], opt.state[net.mid.bias]["momentum_buffer"])
    assert part["class"] == "torch.optim.sgd.SGD" and part["state"] == {}
    (group,) = part["groups"]
    assert group["params"] == ["emb.weight", "mid.weight", "mid.bias"]  # every parameter of the group
    assert group["settings"]["lr"] == 0.1 and group["settings"]["momentum"] == 0.9
    json.dumps(part)  # the JSON part is JSON


def test_no_optimizer_has_an_empty_state() -> None:
    assert train_state.optimizer_state(None, Tied(), ["mid.weight"]) == (
        {}, {"class": None, "groups": [], "state": {}})


def test_a_setting_plait_cannot_save_is_named() -> None:
    net, opt = trained("sgd", steps=0)
    opt.param_groups[0]["schedule"] = {"warmup": 10}
    with pytest.raises(CheckpointError) as info:
        train_state.optimizer_state(opt, net, [])
    assert str(info.value).startswith("param group setting 'schedule' is a dict; plait saves optimizer settings")


def restore_into_a_fresh_copy(net: nn.Module, opt: torch.optim.Optimizer, names: list[str],
                              lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    tensors, part = train_state.optimizer_state(opt, net, names)
    fresh = copy.deepcopy(net)
    fresh_opt = type(opt)(fresh.parameters(), lr=lr)
    count = train_state.restore_optimizer(fresh_opt, fresh, list(fresh.parameters()), {0: (tensors, part)})
    return fresh, fresh_opt, count


def test_adam_state_and_changed_settings_come_back_exactly() -> None:
    net, opt = trained("adam")
    opt.param_groups[0]["lr"] = 0.025  # a scheduler changed it: the saved value wins
    fresh, fresh_opt, count = restore_into_a_fresh_copy(net, opt, ["emb.weight", "mid.weight", "mid.bias"])
    assert count == 3 and fresh_opt.param_groups[0]["lr"] == 0.025
    for (name, p), q in zip(net.named_parameters(), fresh.parameters()):
        assert opt.state[p].keys() == fresh_opt.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)


def test_only_the_parameters_saved_get_a_state() -> None:
    net, opt = trained("adam")
    fresh, fresh_opt, count = restore_into_a_fresh_copy(net, opt, ["mid.bias"])
    assert count == 1 and list(fresh_opt.state) == [fresh.mid.bias]


def test_another_optimizer_class_is_not_restored(caplog: pytest.LogCaptureFixture) -> None:
    net, opt = trained("adam")
    tensors, part = train_state.optimizer_state(opt, net, ["mid.bias"])
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="plait"):
        assert train_state.restore_optimizer(sgd, net, list(net.parameters()), {0: (tensors, part)}) == 0
    assert "the checkpoint's optimizer is ['torch.optim.adam.Adam'], this one is torch.optim.sgd.SGD" in caplog.text
    assert not sgd.state


def test_a_state_with_other_keys_than_this_optimizer_keeps_is_refused() -> None:
    net, opt = trained("adam")
    tensors, part = train_state.optimizer_state(opt, net, ["mid.bias"])
    del tensors["optimizer/mid.bias/exp_avg_sq"]
    with pytest.raises(CheckpointError) as info:
        train_state.restore_optimizer(opt, net, [net.mid.bias], {0: (tensors, part)})
    assert str(info.value) == ("the optimizer state of 'mid.bias' holds ['exp_avg', 'step'], this optimizer keeps "
                               "['exp_avg', 'exp_avg_sq', 'step']")


def test_a_malformed_optimizer_part_is_a_checkpoint_error() -> None:
    net, opt = trained("adam")
    with pytest.raises(CheckpointError, match=r"^the checkpoint's optimizer state is malformed or does not fit "
                                              r"this optimizer \(TypeError: "):
        train_state.restore_optimizer(opt, net, list(net.parameters()), {0: ({}, {"groups": 5})})


# -- RNG states ---------------------------------------------------------------------------------


def draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_rng_states_come_back_exactly() -> None:
    tensors, state = train_state.rng_state()
    assert list(tensors) == ["rng/torch"]  # no CUDA initialised here
    json.dumps(state)
    want = draws()
    assert draws() != want
    train_state.restore_rng(tensors, state)
    assert draws() == want


def test_a_malformed_rng_state_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match=r"^the checkpoint's RNG state is malformed \(ValueError: "):
        train_state.restore_rng({}, {"python": [3, [1, 2], None]})


# -- names and shapes ---------------------------------------------------------------------------


def test_check_names_lists_missing_unexpected_and_mismatched() -> None:
    train_state.check_names({"a": (2,), "b": (3,)}, {"b": (3,), "a": (2,)}, "the checkpoint")  # fits
    with pytest.raises(CheckpointError) as info:
        train_state.check_names({"a": (2,), "b": (3,), "c": (1,)}, {"a": (2, 1), "d": (4,)}, "the checkpoint")
    assert str(info.value) == (
        "the checkpoint does not fit the model: missing from the checkpoint (2): b, c; unexpected in the "
        "checkpoint (1): d; shape mismatch (1): a: model [2], saved [2, 1]. Load it into the model it was saved "
        "from (the same architecture and sizes)")


def test_check_names_shows_twenty_names_and_counts_the_rest() -> None:
    expected = {f"w{i}": (1,) for i in range(23)}
    with pytest.raises(CheckpointError) as info:
        train_state.check_names(expected, {}, "the file")
    shown = ", ".join(f"w{i}" for i in range(20))
    assert f"missing from the file (23): {shown}, ... (3 more). Load it" in str(info.value)


def test_copy_into_fills_tied_names_from_one_value() -> None:
    net = Tied()
    values = {"scale": torch.ones(1), "emb.weight": torch.arange(15.0).reshape(5, 3),
              "mid.weight": torch.eye(3), "mid.bias": torch.zeros(3)}
    train_state.copy_into(net, values, {"head.weight": "emb.weight"}, "the checkpoint")
    assert torch.equal(net.head.weight, values["emb.weight"]) and net.head.weight is net.emb.weight
    assert torch.equal(net.scale, torch.ones(1)) and torch.equal(net.mid.weight, torch.eye(3))
    with pytest.raises(CheckpointError, match=r"missing from the state dict \(1\): mid.bias"):
        train_state.copy_into(Tied(), {k: v for k, v in values.items() if k != "mid.bias"},
                              {"head.weight": "emb.weight"}, "the state dict")


# -- a snapshot saved and restored ----------------------------------------------------------------


def test_a_snapshot_written_and_restored_brings_back_optimizer_and_rng(tmp_path) -> None:
    net, opt = trained("adam")
    snap = train_state.snapshot(net, {}, 0, opt)
    assert set(snap.index) == {"state_keys", "aliases", "tensors"}
    assert {"scale", "emb.weight", "mid.weight", "mid.bias", "rng/torch"} <= set(snap.tensors)
    assert "optimizer/emb.weight/exp_avg" in snap.tensors and "head.weight" not in snap.tensors
    assert json.loads(snap.metadata["plait"])["rank"] == 0
    temp = disk.temp_dir(tmp_path, 2, "t0")
    size, digest = disk.write_shard(temp, 0, snap.tensors, snap.metadata)
    meta = {"step": 2, **snap.index, "plan": None,
            "shards": [{"file": "rank0.safetensors", "bytes": size, "sha256": digest}]}
    ckpt = disk.open_checkpoint(disk.commit(tmp_path, temp, 2, meta, 2), verify=True)
    want = draws()
    fresh = copy.deepcopy(net)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    train_state.restore(ckpt, fresh, fresh_opt, fresh.parameters(), 0, same_layout=True)
    assert draws() == want  # the RNG states of the snapshot
    for p, q in zip(net.parameters(), fresh.parameters()):
        assert all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in opt.state[p])
