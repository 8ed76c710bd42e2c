"""Real models train unchanged: Hugging Face GPT-2, BERT and Llama, and a residual CNN, against one process.

The models are built from tiny configs with random weights (nothing is downloaded). Every rank
trains plait and, on the side, a deep copy in one process, and returns what differs: the loss of
each step, the last step's gradients, the full gathered state dict, and `predict`'s logits.
fp32 tolerances as in test_equivalence: rtol 1e-5 with atol 1e-6 on parameters and buffers,
atol 1e-5 on gradients and outputs. Observed: at most 6e-8 on the state, 2e-7 on the logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from tests.harness import run_ranks
from tests.models import even_cut

transformers = pytest.importorskip("transformers")

BATCHES = (6, 6, 4)  # rows of the three training steps: micro-batches of 2/2/2, then 2/1/1
MICROBATCHES = 3
VOCAB, SEQ = 64, 8
TWO_STAGE_MODELS = ["gpt2", "bert", "llama", "resnet"]
# The name a tied embedding/LM-head weight has in the plan: first stage (embedding) and last (head).
TIED = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
# Captured layers of each model: the cut is given (`even_cut`), so a failure reproduces; the
# planner would cut by this run's timings.
LAYERS = {"gpt2": 23, "bert": 31, "llama": 24, "resnet": 19}


# -- the models ------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs, and a 1x1 strided downsample on the skip when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class TinyResNet(nn.Module):
    """Stem, three basic blocks (the middle one halves H, W and downsamples its skip), pool, linear head."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.layer3 = BasicBlock(16, 16, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))  # (B, 16, H/2, W/2)
        return self.fc(torch.flatten(self.pool(x), 1))  # (B, classes)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on a causal LM's `.logits` (B, T, V) against (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def cls_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy on a classifier's `.logits` (B, C), or on the logits themselves."""
    return F.cross_entropy(getattr(out, "logits", out), y)


@dataclass
class Case:
    net: nn.Module
    x: Any  # a tensor (positional) or a dict (keyword inputs)
    y: torch.Tensor
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    microbatched_reference: bool = False


def _padding_mask(rows: int, g: torch.Generator) -> torch.Tensor:
    """Right padding: 1 on the first 3..SEQ tokens of each row, then 0."""
    lengths = torch.randint(3, SEQ + 1, (rows,), generator=g)
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).long()  # (B, T)


def make(name: str) -> Case:
    """A tiny random-init model with fixed data; no downloads."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    rows = sum(BATCHES)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
        net = transformers.GPT2LMHeadModel(cfg)
        return Case(net, tokens, torch.roll(tokens, -1, dims=1), lm_loss)
    if name == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16,
                                      num_labels=3, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, use_cache=False)
        net = transformers.BertForSequenceClassification(cfg)
        mask = _padding_mask(rows, g)
        x = {"input_ids": tokens * mask, "attention_mask": mask}
        return Case(net, x, torch.randint(0, 3, (rows,), generator=g), cls_loss)
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=16, tie_word_embeddings=True,
                                       attention_dropout=0.0, use_cache=False,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=None)
        net = transformers.LlamaForCausalLM(cfg)
        # Keyword inputs with padding: the causal and padding masks combine inside the model.
        x = {"input_ids": tokens, "attention_mask": _padding_mask(rows, g)}
        return Case(net, x, torch.roll(tokens, -1, dims=1), lm_loss)
    if name == "resnet":
        x = torch.randn(rows, 3, 8, 8, generator=g)
        # Batch norm normalises by the statistics of the batch it sees, which in a pipeline is a
        # micro-batch; the reference therefore accumulates gradients over the same micro-batches.
        return Case(TinyResNet(), x, torch.randint(0, 5, (rows,), generator=g), cls_loss,
                    microbatched_reference=True)
    raise KeyError(name)


# -- one process, for comparison -----------------------------------------------------------------


def _rows(x: Any, a: int, b: int) -> Any:
    return {k: v[a:b] for k, v in x.items()} if isinstance(x, dict) else x[a:b]


def _call(net: nn.Module, x: Any) -> Any:
    return net(**x) if isinstance(x, dict) else net(x)


def _microbatch_bounds(rows: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, MICROBATCHES)  # larger micro-batches first, as plait cuts them
    bounds, start = [], 0
    for i in range(MICROBATCHES):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _reference_step(ref: nn.Module, opt: torch.optim.Optimizer, case: Case, x: Any, y: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    rows = y.shape[0]
    pieces = _microbatch_bounds(rows) if case.microbatched_reference else [(0, rows)]
    total = 0.0
    for a, b in pieces:
        loss = case.loss(_call(ref, _rows(x, a, b)), y[a:b]) * ((b - a) / rows)
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- the check each rank runs -------------------------------------------------------------------


def train_and_compare(name: str, world: int) -> dict[str, Any]:
    """Train `name` with plait on `world` stages and in one process; the mismatches, and what the plan says."""
    case = make(name)
    ref = copy.deepcopy(case.net)
    ref_opt = _sgd(ref.parameters())
    # A short wire timeout: a hang shows as a report naming rank, action and peer, not as a kill.
    config = plait.Config(layers_per_stage=even_cut(LAYERS[name], world), num_microbatches=MICROBATCHES,
                          schedule="1f1b", timeout_s=60.0)
    model = plait.Model(case.net, config=config, optimizer=_sgd(case.net.parameters()), loss=case.loss)
    problems = []
    a = 0
    for rows in BATCHES:
        xb, yb = _rows(case.x, a, a + rows), case.y[a:a + rows]
        got = model.train_on_batch(xb, yb)
        want = _reference_step(ref, ref_opt, case, xb, yb)
        if abs(got - want) > 1e-5 * abs(want) + 1e-6:
            problems.append(f"loss of rows {a}:{a + rows}: {got} != {want}")
        a += rows

    ref_params = dict(ref.named_parameters())
    for pname, p in case.net.named_parameters():  # the last step's gradients, of what this rank trains
        if p.grad is not None:
            try:  # sums over micro-batches in another order: atol 1e-5 as in test_equivalence
                torch.testing.assert_close(p.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-5)
            except AssertionError as e:
                problems.append(f"grad {pname}: {e}")

    state, want_state = model.state_dict(), ref.state_dict()
    if list(state) != list(want_state):
        problems.append(f"state_dict keys {list(state)} != {list(want_state)}")
    for key, value in want_state.items():
        try:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
        except (AssertionError, KeyError) as e:
            problems.append(f"state {key}: {e}")

    ref.eval()
    with torch.no_grad():
        want_out = _call(ref, case.x)
    got_out = model.predict(case.x, batch_size=BATCHES[0])
    if type(got_out) is not type(want_out):
        problems.append(f"predict returned {type(got_out).__name__}, the model returns {type(want_out).__name__}")
    try:
        torch.testing.assert_close(getattr(got_out, "logits", got_out), getattr(want_out, "logits", want_out),
                                   rtol=1e-5, atol=1e-5)
    except (AssertionError, TypeError) as e:
        problems.append(f"predict: {e}")
    plan = model.plan
    return {"problems": problems, "capture_method": plan.capture_method,
            "tied": dict(plan.tied_parameters), "num_stages": plan.num_stages}


def train_all(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    report = {}
    for name in names:
        try:
            report[name] = train_and_compare(name, world)
        except Exception as e:
            raise RuntimeError(f"{name} on {world} ranks: {type(e).__name__}: {e}") from e
    return report


def _check(report: list[dict[str, Any]], name: str, world: int) -> None:
    problems = [f"rank {r}: {p}" for r, rank_report in enumerate(report) for p in rank_report[name]["problems"]]
    assert not problems, "\n".join(problems)
    tied = TIED.get(name)
    for rank_report in report:
        got = rank_report[name]
        assert got["capture_method"] == "torch.export", got
        assert got["num_stages"] == world
        if tied is not None:
            assert got["tied"] == {tied: (0, world - 1)}, f"tied parameters {got['tied']}, expected {tied}"
        else:
            assert got["tied"] == {}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every model on 2 ranks, in one spawn: importing torch and transformers per rank costs more than a model."""
    return run_ranks(2, train_all, TWO_STAGE_MODELS, timeout=200)


@pytest.mark.parametrize("name", TWO_STAGE_MODELS)
@pytest.mark.timeout(240)  # the first test also waits for the shared 2-rank run
def test_two_stages(two_ranks: list[dict[str, Any]], name: str) -> None:
    _check(two_ranks, name, 2)


@pytest.mark.timeout(150)
def test_llama_three_stages() -> None:
    """The masks and RoPE's cos/sin, made on stage 0, cross to the next block's attention; the tied head is on stage 2."""
    _check(run_ranks(3, train_all, ["llama"], timeout=140), "llama", 3)
