"""Analytic costs of a described GPT: parameter counts, Megatron's FLOPs, activation bytes (the device
presets: tests/cost/test_devices.py)."""

from __future__ import annotations

import pytest

from plait.cost.analytic import (
    ALPA_GPT_SUITE,
    GptSpec,
    gpt_costs,
    gpt_tp_shares,
    integer,
    key_values,
    parse_gpt,
)
from plait.cost.devices import device
from plait.errors import ConfigError


@pytest.mark.parametrize("gpus", sorted(ALPA_GPT_SUITE))
def test_suite_parameter_counts_match_their_names(gpus: int) -> None:
    # the names count a tied head: blocks + embeddings; within 4% of the label
    label, spec = ALPA_GPT_SUITE[gpus]
    named = float(label.rstrip("MB")) * (1e6 if label.endswith("M") else 1e9)
    tied = spec.parameters - spec.vocab * spec.hidden
    assert abs(tied - named) / named < 0.04


def test_flops_are_megatrons() -> None:
    # Narayanan et al. 2021: one pass forward + backward is 72 B s l h^2 (1 + s/6h + V/12lh), at the
    # CPU preset's sustained FLOP/s (a GPU's operators are timed by the roofline: test_roofline.py)
    spec = GptSpec(layers=4, hidden=512, heads=8, seq=256, vocab=1000)
    dev = device("cpu")
    costs = gpt_costs(spec, dev)
    row_time = sum(costs.forward_row_s[1:]) + sum(costs.backward_row_s[1:]) + sum(costs.weight_row_s[1:])
    s, h, l, v = spec.seq, spec.hidden, spec.layers, spec.vocab
    want = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert row_time * dev.flops == pytest.approx(want)
    assert costs.forward_fixed_s == (dev.kernel_overhead_s,) * (l + 2)


def test_each_micro_batchs_weight_gradient_is_added_into_the_accumulated_one() -> None:
    # W's fixed part: the kernels' gaps plus the add of each micro-batch's gradients (both read,
    # one written) at the memory bandwidth; it splits over tp as the parameters do
    from plait.cost.network import Link
    from plait.cost.tp_costs import at_tp
    spec = GptSpec(layers=2, hidden=1024, heads=16, seq=512, vocab=1000)
    dev = device("a100-80gb")
    costs = gpt_costs(spec, dev)
    params = [p / dev.dtype_bytes for p in costs.param_bytes]
    assert params[1] == 12 * 1024**2 + 13 * 1024
    for p, fixed in zip(params, costs.weight_fixed_s):
        assert fixed == pytest.approx(dev.kernel_overhead_s + 3 * 2 * p / 1.8e12)
    split = at_tp(costs, gpt_tp_shares(spec, dev, 8), Link(0.0, 1e30))
    for layer in range(len(params)):  # the embedding by vocabulary rows (positions whole), blocks, head
        kept = split.param_bytes[layer] / costs.param_bytes[layer]
        assert split.weight_fixed_s[layer] == pytest.approx(costs.weight_fixed_s[layer] * kept)
    assert split.param_bytes[1] < costs.param_bytes[1] / 7


def test_megatrons_iteration_flops_give_its_training_time_estimate() -> None:
    # SC'21: GPT-3 175B on 300B tokens with 1024 GPUs at 140 TFLOP/s takes about 34 days (their
    # 8TP/(nX)); equation 3 per token is ~8 x parameters, so it gives the same days
    from plait.cost.analytic import megatron_flops
    gpt3 = GptSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    per_token = megatron_flops(gpt3, 1536) / (1536 * 2048)
    assert per_token == pytest.approx(8 * 175e9, rel=0.05)
    assert per_token * 300e9 / (1024 * 140e12) / 86400 == pytest.approx(34, abs=1.5)
    assert megatron_flops(gpt3, 2) == pytest.approx(2 * megatron_flops(gpt3, 1))


def test_a_gpu_preset_times_each_block_by_the_roofline() -> None:
    from plait.cost.roofline import block_times, head_times
    spec = GptSpec(layers=2, hidden=2304, heads=24, seq=2048, vocab=51200)
    dev = device("a100-80gb")
    costs = gpt_costs(spec, dev)
    block, head = block_times(2048, 2304, 24, dev.gpu), head_times(2048, 2304, 51200, dev.gpu)
    assert (costs.forward_row_s[1], costs.backward_row_s[1], costs.weight_row_s[1]) == (
        block.forward_s, block.backward_s, block.weight_s)
    assert costs.forward_row_s[-1] == head.forward_s
    # no efficiency factor: Megatron's FLOPs of a block run between 40% and 100% of the peak here
    # (its published 1.7B row: 137 of 312 TFLOP/s a GPU over the whole step)
    flops = 72 * spec.seq * spec.hidden**2 * (1 + spec.seq / (6 * spec.hidden))
    rate = flops / (block.forward_s + block.backward_s + block.weight_s) / dev.peak_flops
    assert 0.4 < rate < 1.0


def test_tp_shares_give_one_ranks_roofline_time() -> None:
    # at_tp's 1 - a + a/tp of the whole block is the block's time at the tp ranks' GEMM shapes
    from plait.cost.roofline import block_times
    spec = GptSpec(layers=2, hidden=2048, heads=16, seq=1024, vocab=51200)
    dev = device("a100-40gb")
    whole, part = block_times(1024, 2048, 16, dev.gpu), block_times(1024, 2048, 16, dev.gpu, tp=8)
    a = gpt_tp_shares(spec, dev, 8).split_share[1]
    total = lambda t: t.forward_s + t.backward_s + t.weight_s  # noqa: E731
    assert (1 - a + a / 8) * total(whole) == pytest.approx(total(part))
    assert 0.9 < a < 1.0  # the norms and residual adds stay whole


def test_bytes_per_layer() -> None:
    spec = GptSpec(layers=2, hidden=1024, heads=16, seq=1024, vocab=51200)
    costs = gpt_costs(spec, device("v100-16gb"))
    s, h, a = 1024, 1024, 16
    assert costs.names == ("embedding", "block0", "block1", "head")
    assert costs.activation_row_bytes[1] == s * h * (34 + 5 * a * s / h)  # Korthikanti et al.
    assert costs.output_row_bytes[1] == s * h * 2  # the fp16 hidden state crosses a cut
    assert costs.param_bytes[1] == 2 * (12 * h * h + 13 * h)
    assert costs.input_row_bytes == 8 * s
    fp32 = gpt_costs(spec, device("cpu"))
    assert fp32.activation_row_bytes[1] == 2 * costs.activation_row_bytes[1]


def test_parse_gpt() -> None:
    assert parse_gpt("layers=48,hidden=8192,heads=64,seq=1024,vocab=51200") == GptSpec(48, 8192, 64)
    assert parse_gpt("layers=2, hidden=64, heads=4") == GptSpec(2, 64, 4, 1024, 51200)
    with pytest.raises(ConfigError, match="lacks heads"):
        parse_gpt("layers=2,hidden=64")
    with pytest.raises(ConfigError, match="cannot read 'depth=2'"):
        parse_gpt("depth=2,hidden=64,heads=4")
    with pytest.raises(ConfigError, match="not a multiple of heads=3"):
        parse_gpt("layers=2,hidden=64,heads=3")


def test_gpt_tp_shares_are_megatrons_layout() -> None:
    spec, dev = parse_gpt("layers=2,hidden=64,heads=8,seq=16,vocab=100"), device("a100-40gb")
    shares = gpt_tp_shares(spec, dev, 4)
    d, h, s = dev.dtype_bytes, 64, 16
    assert shares.split_bytes == (100 * h * d, (12 * h * h + 7 * h) * d, (12 * h * h + 7 * h) * d, 100 * h * d)
    assert shares.forward_reduce_row_bytes[1:3] == (2 * s * h * d,) * 2  # attention's and the MLP's g
    assert shares.backward_reduce_row_bytes[1:3] == (2 * s * h * d,) * 2  # their f
    assert shares.gather_row_bytes == (0.0,) * 4  # the logits stay split: the vocabulary-parallel loss
    assert shares.forward_reduce_row_bytes[3] == 3 * s * 4 and shares.forward_collectives[3] == 3  # max, sum, nll
    assert shares.backward_reduce_row_bytes[3] == s * h * d + s * 4 and shares.backward_collectives[3] == 2
    mlp_only = gpt_tp_shares(parse_gpt("layers=1,hidden=64,heads=2,seq=16,vocab=100"), dev, 4)  # 2 heads on 4
    assert mlp_only.split_bytes[1] == (8 * h * h + 5 * h) * d and mlp_only.forward_collectives[1] == 1


def test_items_are_read_in_order_with_spaces_and_empty_items_dropped() -> None:
    assert key_values(" a=1, b = x ,,", "--opt", ("a", "b"), "a=A") == {"a": "1", "b": "x"}
    assert key_values("", "--opt", ("a",), "a=A") == {}


@pytest.mark.parametrize("text, item", [("a=1,c=2", "c=2"), ("a", "a")])
def test_an_unknown_key_or_a_missing_value_is_named_with_the_form(text: str, item: str) -> None:
    with pytest.raises(ConfigError, match=f"cannot read '{item}' in --opt '{text}'; write a=A"):
        key_values(text, "--opt", ("a",), "a=A")


def test_integers_are_checked() -> None:
    assert integer("--opt", "a", "12") == 12
    with pytest.raises(ConfigError, match=r"--opt a='1.5' is not an integer"):
        integer("--opt", "a", "1.5")
