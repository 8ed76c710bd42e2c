"""Mixed precision (Config(precision="bf16" | "fp16")) trains as a low-precision copy over fp32 master weights does in one process.

The reference is plain PyTorch by hand, in one process: a copy of the model with bf16 parameters
(buffers as they are) computes each micro-batch (floating inputs cast to bf16, logits to fp32 before the loss), its gradients are added
into fp32 gradients of the fp32 master model after each micro-batch, the optimizer steps the
masters and the copy takes their values before the next step. plait must land close to that and
at least 10x closer to it than to fp32 training of the same model (the issue's bar).

Tolerance: after three Adam steps (lr 1e-2) the parameters differ from the reference by at most
BF16_ATOL. What plait changes is only where the fp32 gradient sums are added (micro-batches per
replica, replicas summed in fp32: another order of fp32 additions, a few fp32 ulps of a gradient).
Measured on this machine after three SGD steps (lr 0.1): GPT-2, Llama and BERT, on 2 stages and on
2 stages x 2 replicas, equal to the reference (0.0), while fp32 training was 6.4e-5 .. 5.6e-4 away.
fp16 with loss scaling (GPT-2, against torch.amp.GradScaler by hand): equal (0.0), fp32 1.0e-5 and
1.3e-5 away; a scale of 2**19 overflows at the sixth step, skipped on both ranks as GradScaler does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plait
from tests.architectures import make
from tests.harness import run_ranks
from tests.precision_reference import (
    LR,
    by_hand,
    by_hand_fp16,
    copies,
    fp32,
    fused_by_hand,
    microbatch,
    sgd,
)

STEPS, MICROBATCHES = 3, 2
BF16_ATOL = 1e-6  # see the module docstring
MODELS = ["gpt2", "llama", "bert"]


def train_bf16(rank, world, name, config):
    arch = make(name)
    initial = copy.deepcopy(arch.net)  # the reference starts here (the build frees what other ranks hold)
    model = plait.Model(arch.net, config, optimizer=sgd, loss=arch.loss)
    plan = model.build(arch.x)  # the micro-batches as plait cuts them (planned, or as given)
    assert len(arch.y) % (plan.num_microbatches * plan.dp) == 0, plan
    for _ in range(STEPS):
        model.train_on_batch(arch.x, arch.y)
    state = model.state_dict()
    # each micro-batch's bf16 gradient is rounded once before it is added in fp32: the reference's
    # micro-batches are plait's (16 rows: 8 a micro-batch on one replica of two micro-batches)
    # (batched weight gradients: their fp32 accumulation, tests/runtime/precision/test_batched_weight_grads.py)
    reference = (fused_by_hand if plan.batch_weight_grads else by_hand)(
        initial, arch.x, arch.y, arch.loss, STEPS, len(arch.y) // (plan.num_microbatches * plan.dp), torch.bfloat16,
        bool(plan.tied_parameters))
    full = fp32(initial, arch.x, arch.y, arch.loss, STEPS)

    def diff(other: nn.Module) -> float:
        return max(float((state[k] - v).abs().max()) for k, v in other.state_dict().items() if v.is_floating_point())

    return {"to_reference": diff(reference), "to_fp32": diff(full), "plan": model.plan.to_json(),
            "dtypes": sorted({str(v.dtype) for v in state.values() if v.is_floating_point()})}


LAYOUTS = {  # world size, config
    "2 stages": (2, dict(num_stages=2, num_microbatches=MICROBATCHES)),
    "2 stages x 2 replicas": (4, dict(num_stages=2, dp=2, num_microbatches=MICROBATCHES)),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_bf16_trains_as_a_bf16_copy_over_fp32_masters(name, layout):
    world, fields = LAYOUTS[layout]
    results = run_ranks(world, train_bf16, name, plait.Config(precision="bf16", **fields), timeout=380)
    for r in results:
        plan = plait.Plan.from_json(r["plan"])
        assert plan.precision == "bf16" and plan.num_stages == 2
        assert r["dtypes"] == ["torch.float32"]  # the masters: state_dict() is fp32
        assert r["to_reference"] <= BF16_ATOL, r
        assert r["to_fp32"] >= 10 * max(r["to_reference"], 1e-7), r  # far closer to bf16 than to fp32


@pytest.mark.timeout(400)
def test_config_with_precision_alone_plans_a_bf16_run_that_trains_as_the_reference():
    """The path users take: Config(precision="bf16") on 2 ranks, the planner choosing the rest."""
    results = run_ranks(2, train_bf16, "gpt2", plait.Config(precision="bf16"), timeout=380)
    assert results[0]["plan"] == results[1]["plan"]
    plan = plait.Plan.from_json(results[0]["plan"])
    assert plan.precision == "bf16"
    atol, bar = (TP_ATOL, 2) if plan.tp > 1 else (BF16_ATOL, 10)  # whichever layout the planner chose
    for r in results:
        assert r["to_reference"] <= atol and r["to_fp32"] >= bar * max(r["to_reference"], 1e-7), r


# Tensor parallelism splits the sums of its products over the ranks: each rank's partial sum and
# the all-reduce run in fp32 and the result is rounded to bf16 once, as one process's product
# rounds it (`plait.runtime.tp.tensor_parallel`: Widen, WideProduct, Narrow). Measured after three
# steps at tp=2 (from the reference, from fp32): GPT-2 0.0, 1.1e-4; Llama (4 key/value heads,
# "llama_mha") 6.1e-6, 8.2e-5; BERT 0.0, 5.5e-4. With the partial sums rounded to bf16 and all-reduced in it
# (Megatron's way) GPT-2, Llama (grouped-query) and BERT were 1.1e-4, 7.5e-5 and 3.4e-4 from the
# reference: as far as from fp32. Llama with grouped-query attention (2 key/value heads for 4 query
# heads, "llama") still lands 5.0e-5 from the reference and 8.4e-5 from fp32: within bf16's
# rounding, not 2x closer: a split sum adds its parts in another fp32 order than one process's
# product, which now and then rounds a gradient to the neighbouring bf16 value; traced here to the
# attention's input gradient on one rank (1 bf16 step of 3.6e-3), these flips grow through its two
# layers. The reference itself moves as far under another fp32 order (another matrix-product kernel:
# 5.0e-5, 1.6x closer than fp32, for either Llama): the 2x bar lies below bf16's own noise for Llama
# (test_the_one_process_reference_moves_as_far_under_another_fp32_order_as_a_split_sum_does).
TP_ATOL = 2e-5  # a split sum added in another fp32 order flips a bf16 rounding now and then (6.1e-6 above)


TP_LAYOUTS = {  # world size, model, config (stages of widths 2 and 1, measured: 0.0 from the reference)
    "gpt2 tp=2": (2, "gpt2", dict(num_stages=1, tp=2)), "llama_mha tp=2": (2, "llama_mha", dict(num_stages=1, tp=2)),
    "bert tp=2": (2, "bert", dict(num_stages=1, tp=2)), "gpt2 2 stages x tp=2": (4, "gpt2", dict(num_stages=2, tp=2)),
    "gpt2 stage_tp=(2, 1)": (3, "gpt2", dict(stage_tp=(2, 1), layers_per_stage=(12, 11))),
    # sequence parallel: RMSNorm's weight gradient summed over the split tokens in fp32 (6.1e-6)
    "llama_mha tp=2 sequence parallel": (2, "llama_mha", dict(num_stages=1, tp=2, sequence_parallel=True)),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(TP_LAYOUTS))
def test_bf16_with_tensor_parallelism_sums_split_products_in_fp32(case):
    world, name, fields = TP_LAYOUTS[case]
    results = run_ranks(world, train_bf16, name, plait.Config(precision="bf16", num_microbatches=MICROBATCHES, **fields),
                        timeout=380)
    for r in results:
        plan = plait.Plan.from_json(r["plan"])
        assert plan.precision == "bf16" and plan.tp == 2 and plan.tp_layouts
        assert r["to_reference"] <= TP_ATOL, r
        assert r["to_fp32"] >= 2 * max(r["to_reference"], 1e-7), r  # the bar where a sum is split


@pytest.mark.timeout(400)
def test_bf16_tensor_parallel_grouped_query_attention_stays_within_bf16_rounding_of_the_reference():
    """Llama with 2 key/value heads for 4 query heads at tp=2: measured 5.0e-5 from the reference
    after three steps (8.4e-5 from fp32): bf16-close, not the 2x bar -- which the reference itself
    misses under another fp32 order (the test below)."""
    results = run_ranks(2, train_bf16, "llama", plait.Config(precision="bf16", num_stages=1, tp=2,
                                                             num_microbatches=MICROBATCHES), timeout=380)
    for r in results:
        assert plait.Plan.from_json(r["plan"]).tp == 2
        assert r["to_reference"] <= 1e-4, r


@pytest.mark.timeout(120)
def test_the_one_process_reference_moves_as_far_under_another_fp32_order_as_a_split_sum_does():
    """Why Llama's split sums cannot be 2x closer to the reference than fp32 training is: the reference
    itself, its linears' products summed in another fp32 order (each bf16 product's inner sum cut in
    two halves, added in fp32, rounded once: what another kernel's blocking, or tp=2's split, does),
    lands 5.0e-5 from itself after three steps -- as far as plait's tp=2 run (5.0e-5) -- against
    8.4e-5 from fp32: 1.7x. A bf16 rounding that flips with the fp32 order grows through the steps.
    (Measured with oneDNN turned off as the other order, on a CPU where that changes the kernel:
    5.0e-5 too; GPT-2 and BERT: 1.9e-7 and 1.5e-6, hundreds of times closer than fp32; fp16 GPT-2
    under 2 threads instead of 1: 6.1e-6 against 1.3e-5 from fp32, 2.1x, where plait's fp16 tp=2
    lands 9.5e-6.) The halves are summed by hand, so the other order is there on every CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (tests/harness.py)
    linear = nn.functional.linear

    def halves(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        h = w.shape[1] // 2  # bf16 x bf16 products are exact in fp32: only the order of the sum differs
        y = x[..., :h].float() @ w[:, :h].float().t() + x[..., h:].float() @ w[:, h:].float().t()
        return (y if b is None else y + b.float()).to(x.dtype)

    try:
        arch = make("llama")
        rows = len(arch.y) // MICROBATCHES
        reference = by_hand(copy.deepcopy(arch.net), arch.x, arch.y, arch.loss, STEPS, rows, torch.bfloat16, False)
        nn.functional.linear = halves
        try:
            reordered = by_hand(copy.deepcopy(arch.net), arch.x, arch.y, arch.loss, STEPS, rows, torch.bfloat16, False)
        finally:
            nn.functional.linear = linear
        full = fp32(copy.deepcopy(arch.net), arch.x, arch.y, arch.loss, STEPS)
    finally:
        torch.set_num_threads(threads)

    def apart(a: nn.Module, b: nn.Module) -> float:
        sa = a.state_dict()
        return max(float((sa[k] - v).abs().max()) for k, v in b.state_dict().items() if v.is_floating_point())

    moved, from_fp32 = apart(reference, reordered), apart(reference, full)
    assert 2e-5 < moved and from_fp32 < 2 * moved, (moved, from_fp32)


SP_LAYER_NORM = {"gpt2": 7e-5, "bert": 3.5e-4}  # measured after three steps: 4.9e-5 and 2.4e-4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(SP_LAYER_NORM))
def test_bf16_sequence_parallel_with_layer_norms_is_closer_to_the_reference_than_fp32(name):
    """Sequence parallelism splits the tokens a layer norm's weight gradient sums over. torch's bf16
    layer-norm kernel rounds that sum in blocks of its own (checked alone: its weight gradient lies
    up to four bf16 steps from the fp32-weight kernel's), so no split of the tokens reproduces it,
    and fp32 weights would change its input gradient too: each rank runs the bf16 kernel on its
    tokens and the parts are summed. Measured after three steps: GPT-2 4.9e-5 from the reference,
    8.2e-5 from fp32 (1.7x); BERT 2.4e-4 and 5.5e-4 (2.3x); the row-parallel sums, biases and
    RMSNorm's elementwise weight are summed in fp32 (Llama above: 6.1e-6). Before those were,
    GPT-2 was further from the reference than fp32 was (1.5e-4 against 1.1e-4)."""
    results = run_ranks(2, train_bf16, name, plait.Config(precision="bf16", num_stages=1, tp=2, sequence_parallel=True,
                                                          num_microbatches=MICROBATCHES), timeout=380)
    for r in results:
        assert plait.Plan.from_json(r["plan"]).sequence_parallel
        assert r["to_reference"] <= SP_LAYER_NORM[name], r
        assert r["to_reference"] < r["to_fp32"], r


COMPOSED = {  # world size, config: bf16 beside the schedules, recomputation and ZeRO
    "zbh1 (split backward)": (2, dict(num_stages=2, num_microbatches=2, schedule="zbh1")),
    "interleaved": (2, dict(num_stages=2, num_microbatches=2, schedule="interleaved", num_virtual_stages=2)),
    "recompute by layer": (2, dict(num_stages=2, num_microbatches=2, recompute=True, recompute_by_layer=True)),
    "zero 2": (4, dict(num_stages=2, dp=2, num_microbatches=2, zero=2)),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(COMPOSED))
def test_bf16_composes_with_schedules_recomputation_and_zero(case):
    world, fields = COMPOSED[case]
    results = run_ranks(world, train_bf16, "gpt2", plait.Config(precision="bf16", **fields), timeout=380)
    for r in results:
        assert plait.Plan.from_json(r["plan"]).precision == "bf16"
        assert r["to_reference"] <= BF16_ATOL and r["to_fp32"] >= 10 * max(r["to_reference"], 1e-7), r


def save_bf16_then_load_fp32(rank, world, root):
    """A bf16 run on 2 stages saves; an fp32 run on 2 replicas of one stage loads it and goes on."""
    arch = make("gpt2")
    trained = plait.Model(copy.deepcopy(arch.net), plait.Config(precision="bf16", num_stages=2, num_microbatches=2),
                          optimizer=sgd, loss=arch.loss)
    for _ in range(2):
        trained.train_on_batch(arch.x, arch.y)
    trained.save(root)
    saved = trained.state_dict()
    again = plait.Model(copy.deepcopy(arch.net), plait.Config(num_stages=1, dp=2), optimizer=sgd, loss=arch.loss)
    again.build(arch.x)
    step = again.load(root)
    loaded = again.state_dict()
    return {"step": step, "equal": all(torch.equal(loaded[k], v) for k, v in saved.items()),
            "dtypes": sorted({str(v.dtype) for v in loaded.values() if v.is_floating_point()}),
            "loss": again.train_on_batch(arch.x, arch.y)}


@pytest.mark.timeout(300)
def test_a_bf16_checkpoint_holds_the_fp32_masters_and_loads_into_an_fp32_run_of_another_layout(tmp_path):
    results = run_ranks(2, save_bf16_then_load_fp32, str(tmp_path / "ckpt"), timeout=280)
    for r in results:
        assert r["step"] == 2 and r["equal"] and r["dtypes"] == ["torch.float32"], r
    assert results[0]["loss"] == results[1]["loss"]


def train_fp16(rank, world, config, init_scale, steps, root=None):
    """fp16 on the ranks against GradScaler by hand; with `root`, a checkpoint saved and loaded again."""
    arch = make("gpt2")
    initial = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, config, optimizer=sgd, loss=arch.loss)
    plan = model.build(arch.x)
    model.loss_scale.scale = init_scale  # as GradScaler(init_scale=...)
    scales = []
    for _ in range(steps):
        model.train_on_batch(arch.x, arch.y)
        scales.append(model.loss_scale.scale)
    state = model.state_dict()
    reference, want = by_hand_fp16(initial, arch.x, arch.y, arch.loss, steps,
                                   len(arch.y) // (plan.num_microbatches * plan.dp), bool(plan.tied_parameters),
                                   init_scale)
    full = fp32(initial, arch.x, arch.y, arch.loss, steps)
    resumed = None
    if root is not None:
        model.save(root)
        again = plait.Model(make("gpt2").net, config, optimizer=sgd, loss=arch.loss)
        again.build(arch.x)
        again.load(root)
        resumed = (again.loss_scale.scale, again.loss_scale.growth_tracker)

    def diff(other: nn.Module) -> float:
        return max(float((state[k] - v).abs().max()) for k, v in other.state_dict().items() if v.is_floating_point())

    return {"scales": scales, "want": want, "skipped": model.loss_scale.skipped_steps, "to_reference": diff(reference),
            "to_fp32": diff(full), "resumed": resumed, "tracker": model.loss_scale.growth_tracker}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp16_with_loss_scaling_trains_as_gradscaler_by_hand(layout):
    world, fields = LAYOUTS[layout]
    results = run_ranks(world, train_fp16, plait.Config(precision="fp16", **fields), 2.0**16, STEPS, timeout=380)
    for r in results:
        assert r["scales"] == r["want"] == [2.0**16] * STEPS and r["skipped"] == 0, r
        assert r["to_reference"] <= BF16_ATOL and r["to_fp32"] >= 10 * max(r["to_reference"], 1e-7), r


@pytest.mark.timeout(400)
def test_fp16_with_tensor_parallelism_trains_as_gradscaler_by_hand():
    """fp16 at tp=2 (GPT-2): the loss scale as GradScaler's, the split sums in fp32 (as bf16's).
    Measured: 9.5e-6 from GradScaler by hand, 1.2e-5 from fp32: 1.3x closer, short of the 2x bar
    (fp16's 10-bit mantissa puts fp32 itself close; an fp32 order flipping an fp16 rounding costs as
    much: the reference itself, on 2 threads instead of 1, lands 6.1e-6 from itself, 2.1x closer than
    fp32). Asserted: the scale step for step, and the distance within TP_ATOL."""
    results = run_ranks(2, train_fp16, plait.Config(precision="fp16", num_stages=1, tp=2, num_microbatches=MICROBATCHES),
                        2.0**16, STEPS, timeout=380)
    for r in results:
        assert r["scales"] == r["want"] == [2.0**16] * STEPS and r["skipped"] == 0, r
        assert r["to_reference"] <= TP_ATOL, r


@pytest.mark.timeout(400)
def test_an_fp16_overflow_skips_the_step_on_every_rank_as_gradscaler_does(tmp_path):
    """A scale too large overflows the fp16 gradients: every rank skips those steps and halves the
    scale, step for step as GradScaler; the scale and its count come back from a checkpoint."""
    config = plait.Config(precision="fp16", num_stages=2, num_microbatches=MICROBATCHES)
    # 2**19: measured here, five steps train and the sixth overflows (2**22 and up: every step does)
    results = run_ranks(2, train_fp16, config, 2.0**19, 6, str(tmp_path / "ckpt"), timeout=380)
    for r in results:
        assert r["scales"] == r["want"], r  # the same scale after every step as GradScaler's
        assert 1 <= r["skipped"] < 6, r  # steps skipped and steps taken
        assert r["to_reference"] <= BF16_ATOL, r
        assert r["resumed"] == (r["scales"][-1], r["tracker"]), r
    assert results[0]["scales"] == results[1]["scales"] and results[0]["skipped"] == results[1]["skipped"]


def export_bf16(rank, world, out):
    arch = make("gpt2")
    model = plait.Model(arch.net, plait.Config(precision="bf16", num_stages=2, num_microbatches=2),
                        optimizer=sgd, loss=arch.loss)
    model.train_on_batch(arch.x, arch.y)
    model.export(out, dtype=torch.bfloat16)
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_export_writes_the_dtype_asked_for_and_from_pretrained_reads_it(tmp_path):
    import transformers
    from safetensors import safe_open

    out = str(tmp_path / "hf")
    want = run_ranks(2, export_bf16, out, timeout=280)[0]
    files = sorted(tmp_path.glob("hf/*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), "pt") as opened:
            assert {opened.get_tensor(k).dtype for k in opened.keys()} == {torch.bfloat16}
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.bfloat16)
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in want.items() if k in state)


def meta_bf16(rank, world):
    import transformers

    from tests.architectures import _configs

    arch = make("gpt2")

    def on_meta():
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(_configs(transformers)["gpt2"]())

    model = plait.Model(on_meta(), plait.Config(precision="bf16", num_stages=2, num_microbatches=MICROBATCHES, seed=7),
                        optimizer=sgd, loss=arch.loss)
    for _ in range(STEPS):
        model.train_on_batch(arch.x, arch.y)
    state = model.state_dict()
    initial = plait.materialize(on_meta(), seed=7)  # the values each rank gave its stages, in one process
    reference = by_hand(initial, arch.x, arch.y, arch.loss, STEPS, len(arch.y) // MICROBATCHES, torch.bfloat16,
                        untie=True)
    return max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items() if v.is_floating_point())


@pytest.mark.timeout(300)
def test_a_model_built_on_meta_trains_in_bf16_as_the_reference():
    assert max(run_ranks(2, meta_bf16, timeout=280)) <= BF16_ATOL


def load_then_bf16(rank, world, pretrained):
    arch = make("gpt2")
    source = copy.deepcopy(arch.net)
    with torch.no_grad():
        source.transformer.wte.weight.mul_(2.0)  # weights unlike the model's own start
    pretrained = f"{pretrained}/{rank}"  # each rank its own copy of the files (no process group yet)
    source.save_pretrained(pretrained)
    model = plait.Model(arch.net, plait.Config(precision="bf16", num_stages=2, num_microbatches=MICROBATCHES),
                        optimizer=sgd, loss=arch.loss)
    model.build(arch.x)
    model.load(pretrained)  # into the fp32 masters; the copies take them before the next step
    for _ in range(STEPS):
        model.train_on_batch(arch.x, arch.y)
    state = model.state_dict()
    reference = by_hand(source, arch.x, arch.y, arch.loss, STEPS, len(arch.y) // MICROBATCHES, torch.bfloat16,
                        untie=True)
    return max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items() if v.is_floating_point())


@pytest.mark.timeout(300)
def test_weights_loaded_after_the_build_reach_the_bf16_copies(tmp_path):
    assert max(run_ranks(2, load_then_bf16, str(tmp_path / "pretrained"), timeout=280)) <= BF16_ATOL


def bf16_sums(rank, world):
    """One SGD step of bf16 on 2 replicas with the gradient sums in bf16, and both references."""
    arch = make("gpt2")
    initial = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, plait.Config(precision="bf16", num_stages=1, dp=2, num_microbatches=2,
                                               reduce_precision="bf16"), optimizer=sgd, loss=arch.loss)
    model.train_on_batch(arch.x, arch.y)
    state = model.state_dict()
    master, low, pairs = copies(initial, torch.bfloat16, untie=False)
    replicas = []  # each replica's fp32 gradients: its two micro-batches of 4 rows, each added in fp32
    for r in range(2):
        for start in (8 * r, 8 * r + 4):
            microbatch(low, pairs, arch.x, arch.y, arch.loss, slice(start, start + 4), torch.bfloat16)
        replicas.append({id(p): p.grad.clone() for p in master.parameters()})
        master.zero_grad()

    def stepped(total) -> dict:
        return {n: (p - LR * total(id(p))).detach() for n, p in master.named_parameters()}

    in_bf16 = stepped(lambda i: (replicas[0][i].bfloat16() + replicas[1][i].bfloat16()).float())
    in_fp32 = stepped(lambda i: replicas[0][i] + replicas[1][i])

    def diff(other: dict) -> float:
        return max(float((state[n] - v).abs().max()) for n, v in other.items())

    return {"to_bf16_sums": diff(in_bf16), "to_fp32_sums": diff(in_fp32)}


@pytest.mark.timeout(300)
def test_reduce_precision_bf16_sums_the_replicas_gradients_in_bf16():
    for r in run_ranks(2, bf16_sums, timeout=280):
        assert r["to_bf16_sums"] <= 1e-7 < r["to_fp32_sums"], r  # the bf16 sums, not the fp32 ones


def stage_dp_bf16(rank, world, widths):
    """bf16 on two stages of their own replica counts: a stage of two replicas rounds each half
    micro-batch's bf16 gradient on its own; the reference does the same for that stage's parameters."""
    arch = make("gpt2")
    initial = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, plait.Config(precision="bf16", stage_dp=widths, split_points=["transformer.h.1"],
                                               num_microbatches=2), optimizer=sgd, loss=arch.loss)
    for _ in range(STEPS):
        model.train_on_batch(arch.x, arch.y)
    state = model.state_dict()
    master, low, pairs = copies(initial, torch.bfloat16, untie=True)
    names = {id(lp): n for n, lp in low.named_parameters(remove_duplicate=False)}
    later = ("transformer.h.1", "transformer.ln_f", "lm_head")  # the second stage's modules
    opt = sgd(master.parameters())
    for _ in range(STEPS):
        with torch.no_grad():
            for lp, mp in pairs:
                lp.copy_(mp)
        for stage, dp in enumerate(widths):  # each stage's gradients from its own row blocks
            rows = len(arch.y) // (2 * dp)
            mine = [(lp, mp) for lp, mp in pairs if names[id(lp)].startswith(later) == (stage == 1)]
            for start in range(0, len(arch.y), rows):
                microbatch(low, mine, arch.x, arch.y, arch.loss, slice(start, start + rows), torch.bfloat16)
            low.zero_grad()
        opt.step()
        opt.zero_grad()
    return max(float((state[k] - v).abs().max()) for k, v in master.state_dict().items() if v.is_floating_point())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("widths", [(2, 1), (1, 2)], ids=str)
def test_bf16_on_stages_of_their_own_replica_counts(widths):
    assert max(run_ranks(3, stage_dp_bf16, widths, timeout=280)) <= BF16_ATOL
