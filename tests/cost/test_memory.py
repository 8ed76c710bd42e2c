"""Model-state memory of a rank (`plait.cost.memory`): ZeRO's table worked by hand, and the errors."""

from __future__ import annotations

import pytest

from plait.cost.memory import StateBytes, held_in_precision, optimizer_state_factor, state_bytes, state_totals
from plait.errors import ConfigError
from plait.plan.setting import check_zero
from tests.plan.factory import layer_costs


def test_zero_shares_the_optimizer_state_and_keeps_the_parameters() -> None:
    # 100 bytes of parameters and of gradients, Adam (2 bytes of state per gradient byte), 4 replicas
    assert state_bytes(100.0, 100.0, 2.0, 4, 0) == StateBytes(100.0, 100.0, 200.0, 100.0)
    assert state_bytes(100.0, 100.0, 2.0, 4, 1) == StateBytes(100.0, 100.0, 50.0, 100.0)
    # ZeRO-2: the step holds a quarter of the gradients, but the backward all of them
    assert state_bytes(100.0, 100.0, 2.0, 4, 2) == StateBytes(100.0, 100.0, 50.0, 25.0)
    assert [state_bytes(100.0, 100.0, 2.0, 4, z).total for z in (0, 1, 2)] == [400.0, 250.0, 250.0]
    # the peak is the backward's, with the activations: ZeRO-2's is ZeRO-1's
    assert state_bytes(100.0, 100.0, 2.0, 4, 2).peak(30.0) == state_bytes(100.0, 100.0, 2.0, 4, 1).peak(30.0) == 280.0
    # with one replica there is nothing to shard
    assert state_bytes(100.0, 100.0, 2.0, 1, 0).total == 400.0


def test_the_step_peak_counts_when_the_backward_holds_less() -> None:
    # a hand-made state where the step's gradients exceed the backward's: the max takes it
    odd = StateBytes(parameters=10.0, gradients=1.0, optimizer=5.0, step_gradients=8.0)
    assert odd.total == 23.0 and odd.peak(2.0) == 23.0 and odd.peak(20.0) == 36.0


def test_per_layer_totals_are_the_same_formula() -> None:
    params, grads = [100.0, 0.0, 30.0], [100.0, 0.0, 10.0]
    for zero in (0, 1, 2, 3):
        assert state_totals(params, grads, 6.0, 2, zero) == [
            state_bytes(p, g, 6.0, 2, zero).total for p, g in zip(params, grads)]
    assert state_totals(params, grads, 6.0, 2, 1) == [100 + 100 + 300, 0.0, 30 + 10 + 30]


def test_zero3_in_low_precision_holds_the_master_shards_and_gathers_the_copies() -> None:
    """A bf16 profile's 100 captured bytes are held as 200 bytes of fp32 masters beside the 100 of
    the copy (`held_in_precision`); zero=3 shards the masters and gathers the copies a layer at a
    time (FSDP2's mixed precision): a quarter of the masters per rank of 4 replicas."""
    costs = held_in_precision(layer_costs(3, params=100.0), "bf16")
    assert costs.param_bytes == (300.0,) * 3 and costs.copy_bytes == (100.0,) * 3
    assert state_bytes(300.0, 200.0, 2.0, 4, 3, copy_bytes=100.0).parameters == 50.0
    assert state_bytes(300.0, 200.0, 2.0, 4, 2, copy_bytes=100.0).parameters == 300.0  # below 3: both held
    assert state_totals(costs.param_bytes, costs.grad_bytes, 2.0, 4, 3, costs.copy_bytes) == [
        state_bytes(300.0, 200.0, 2.0, 4, 3, 100.0).total] * 3
    assert held_in_precision(costs, "fp32") is costs


@pytest.mark.parametrize("zero, dp, message", [
    (4, 2, "zero must be 0, 1, 2 or 3, got 4"),
    (True, 2, "zero must be 0, 1, 2 or 3, got True"),
    (3, 1, "zero=3 shards"),
    (1, 1, "zero=1 shards over a stage's replicas, but dp=1 has one replica; set dp > 1 or zero=0"),
    (2, 1, "zero=2 shards"),
])
def test_a_level_that_cannot_be_says_why_and_what_to_set(zero: object, dp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_zero(zero, dp)
    with pytest.raises(ConfigError, match="zero"):
        state_bytes(1.0, 1.0, 2.0, dp, zero)  # type: ignore[arg-type]


def test_other_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="dp must be a positive integer, got 0"):
        state_bytes(1.0, 1.0, 2.0, 0, 0)
    with pytest.raises(ConfigError, match=r"optimizer_state_factor must be >= 0 \(Adam: 2\), got -1"):
        state_totals([1.0], [1.0], -1.0, 2, 1)


def test_optimizer_state_is_zeros_16_bytes_per_parameter() -> None:
    # ZeRO: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; fp32 Adam 4 + 4 + 8
    assert 2 + 2 * (1 + optimizer_state_factor("adam", 2)) == 16
    assert 4 + 4 * (1 + optimizer_state_factor("adam", 4)) == 16
    assert optimizer_state_factor("sgd", 4) == 0 and optimizer_state_factor("sgd-momentum", 4) == 1
    with pytest.raises(ConfigError, match="unknown optimizer"):
        optimizer_state_factor("lion", 2)


def test_the_runtime_reads_the_cost_models_factor_for_an_optimizer_instance() -> None:
    # The story: the runtime and the cost model each wrote their own table of optimizer state
    # (Adam 2, SGD with momentum 1, SGD 0); now the runtime names the instance's kind and asks the cost model.
    import torch

    from plait.runtime.memory.memory_stats import state_factor

    w = [torch.nn.Parameter(torch.zeros(2))]
    assert state_factor(torch.optim.Adam(w)) == optimizer_state_factor("adam", 4) == 2
    assert state_factor(torch.optim.SGD(w, lr=0.1, momentum=0.9)) == optimizer_state_factor("sgd-momentum", 4) == 1
    assert state_factor(torch.optim.SGD(w, lr=0.1)) == optimizer_state_factor("sgd", 4) == 0


def test_offload_leaves_the_device_its_gradients_alone() -> None:
    """zero=3 with offload (FSDP2's CPUOffloadPolicy): the shards, the reduce-scattered gradients and
    the optimizer state live in host memory; the device adds each micro-batch's gradients up whole."""
    assert state_bytes(100.0, 100.0, 2.0, 4, 3, offload=True) == StateBytes(0.0, 100.0, 0.0, 0.0)
    assert state_bytes(100.0, 100.0, 2.0, 4, 3) == StateBytes(25.0, 100.0, 50.0, 25.0)  # without: its shares
    assert state_totals([100.0, 30.0], [100.0, 10.0], 2.0, 4, 3, offload=True) == [100.0, 10.0]
    assert state_bytes(100.0, 100.0, 2.0, 4, 2, offload=True).total == state_bytes(100.0, 100.0, 2.0, 4, 2).total


def test_a_split_backward_at_zero3_holds_the_stage_gathered_beside_its_gradients() -> None:
    """ZB-H1 at zero=3: a piece's parameters stay gathered from a micro-batch's B to its W, in the last
    micro-batches all of them: the compute dtype's bytes (the copies below fp32, else the parameters)
    beside the gradients. Other levels, and zero=3 with a whole backward, are as before."""
    assert state_bytes(100.0, 100.0, 2.0, 4, 3, gathered=True) == StateBytes(25.0, 200.0, 50.0, 25.0)
    assert state_bytes(300.0, 200.0, 2.0, 4, 3, copy_bytes=100.0, gathered=True).gradients == 300.0
    assert state_bytes(100.0, 100.0, 2.0, 4, 3, offload=True, gathered=True) == StateBytes(0.0, 200.0, 0.0, 0.0)
    assert state_bytes(100.0, 100.0, 2.0, 4, 2, gathered=True) == state_bytes(100.0, 100.0, 2.0, 4, 2)
    params, grads, copies = [300.0, 0.0, 60.0], [200.0, 0.0, 40.0], [100.0, 0.0, 0.0]
    for offload in (False, True):
        assert state_totals(params, grads, 2.0, 4, 3, copies, offload, gathered=True) == [
            state_bytes(p, g, 2.0, 4, 3, c, offload, gathered=True).total for p, g, c in zip(params, grads, copies)]
