"""Costs of a described model on a described device, with no profiling: FLOPs and bytes of a GPT.

A GPT of `layers` transformer blocks is `layers + 2` plait layers: the embedding (tokens and
positions), the blocks, and the head (final layer norm and the vocabulary projection). Per
sequence of s tokens, hidden size h, a heads, vocabulary V (Narayanan et al. 2021, SC'21):

    block forward FLOPs    24 s h^2 + 4 s^2 h   (weight matmuls + attention scores/values)
    block backward         input gradient 24 s h^2 + 8 s^2 h (B), weight gradient 24 s h^2 (W)
    head forward           2 s h V; backward 2 s h V (B) + 2 s h V (W)
    block parameters       12 h^2 + 13 h; embedding (V + s) h; head V h + 2 h
    block activations      s h (34 + 5 a s / h) bytes at 16 bits (Korthikanti et al. 2022,
                           no tensor or sequence parallelism), scaled by dtype_bytes / 2

On a GPU preset each layer's time is its operators' roofline (`plait.cost.roofline`: GEMMs by
their shape, element-wise operators by their bytes), on a CPU FLOPs / (peak x efficiency); both
plus a fixed per-layer overhead. The embedding is a gather, timed by the bytes it moves. The head holds its own V x h matrix: an untied head, or the
copy of a tied one that plait keeps on the last stage (counted twice when both share a stage).
The optimizer step moves `OPTIMIZER_TRAFFIC` bytes per parameter through memory. Each micro-batch's
weight gradients are added into the accumulated ones (Megatron-LM's DDP hook `main_grad.add_(grad)`,
autograd's `grad += new`): both read, one written, 3 x dtype_bytes per parameter, at the memory
bandwidth (a fixed part of each W: `benchmarks/overhead_gpu.py` measured such an add at 0.93-1.04
of a copy's bandwidth on an H200, at one rank's share of a Megatron block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from plait.cost.devices import Device
from plait.cost.roofline import BlockTimes, block_times, head_times
from plait.cost.tp_costs import TpShares
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts

__all__ = ["GptSpec", "gpt_costs", "gpt_tp_shares", "parse_gpt", "key_values", "integer",
           "ALPA_GPT_SUITE", "megatron_flops"]

# Bytes read and written per parameter by one optimizer step (fp32 state): Adam reads the
# parameter, gradient, exp_avg, exp_avg_sq and writes three of them back: 7 x 4.
OPTIMIZER_TRAFFIC = {"adam": 28.0, "sgd-momentum": 20.0, "sgd": 12.0}


@dataclass(frozen=True)
class GptSpec:
    """A GPT described by its sizes."""

    layers: int
    hidden: int
    heads: int
    seq: int = 1024
    vocab: int = 51200

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GPT {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"GPT hidden={self.hidden} is not a multiple of heads={self.heads}; pick heads "
                f"dividing the hidden size"
            )

    @property
    def parameters(self) -> int:
        """Parameters of the blocks, embedding and (untied) head."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.seq) * h + self.vocab * h + 2 * h


# Alpa (OSDI'22) Table 6 and its benchmark suite: GPT-3 sizes, seq 1024, vocab 51200, by GPU count.
ALPA_GPT_SUITE: dict[int, tuple[str, GptSpec]] = {
    1: ("350M", GptSpec(24, 1024, 16)),
    2: ("760M", GptSpec(24, 1536, 16)),
    4: ("1.3B", GptSpec(24, 2048, 32)),
    8: ("2.6B", GptSpec(32, 2560, 32)),
    16: ("6.7B", GptSpec(32, 4096, 32)),
    32: ("15B", GptSpec(48, 5120, 40)),
    64: ("39B", GptSpec(48, 8192, 64)),
}


def gpt_tp_shares(spec: GptSpec, dev: Device, tp: int) -> TpShares:
    """What Megatron's layout splits in each layer of `gpt_costs(spec, dev)` on `tp` ranks, as plait's
    runtime runs it: the word embedding by vocabulary rows (its lookups all-reduced), each block's
    q|k|v and first MLP linear by columns and their output linears by rows (2 all-reduces of the
    hidden states in the forward, 2 in the backward; Shoeybi et al. 2019), the head by vocabulary
    rows, its logits left split for the vocabulary-parallel cross-entropy (`plait.runtime.tp.vocab_loss`,
    Megatron's: 3 all-reduces of one fp32 figure per token in the forward, 1 in the backward).
    A block's split activations are Megatron's 24 + 5as/h of its 34 + 5as/h bytes per token and
    hidden unit (Korthikanti et al. 2022); its split share of the work is what makes one rank's time
    (`_block_and_head` at tp, the roofline's shapes on a GPU) that of the whole layer."""
    s, h, a, vocab, d = spec.seq, spec.hidden, spec.heads, spec.vocab, dev.dtype_bytes
    blocks, hidden_row = spec.layers, float(s * h * d)
    attention = 5 * a * s / h
    heads_split = a % tp == 0
    block_split = (12 * h * h + 7 * h) * d if heads_split else (8 * h * h + 5 * h) * d  # the MLP alone otherwise
    block_act = ((24 + attention) / (34 + attention)) if heads_split else 16 / (34 + attention)
    (block1, head1), (block_t, head_t) = _block_and_head(spec, dev, 1), _block_and_head(spec, dev, tp)

    def work(whole: BlockTimes, part: BlockTimes) -> float:  # a of at_tp's 1 - a + a / tp
        total = whole.forward_s + whole.backward_s + whole.weight_s
        ratio = (part.forward_s + part.backward_s + part.weight_s) / total
        return min(1.0, max(0.0, (1 - ratio) / (1 - 1 / tp))) if tp > 1 else 0.0

    def per(first: float, block: float, last: float) -> tuple[float, ...]:  # embedding, blocks, head
        return (float(first),) + (float(block),) * blocks + (float(last),)

    return TpShares(
        tp,
        split_bytes=per(vocab * h * d, block_split, vocab * h * d),
        split_share=per(0.0, work(block1, block_t), work(head1, head_t)),
        activation_share=per(0.0, block_act, 1.0),
        forward_reduce_row_bytes=per(hidden_row, 2 * hidden_row if heads_split else hidden_row, 3 * s * 4),
        backward_reduce_row_bytes=per(0.0, 2 * hidden_row if heads_split else hidden_row, hidden_row + s * 4),
        gather_row_bytes=per(0.0, 0.0, 0.0),
        forward_collectives=per(1, 2 if heads_split else 1, 3),
        backward_collectives=per(0, 2 if heads_split else 1, 2),
    )


def _block_and_head(spec: GptSpec, dev: Device, tp: int) -> tuple[BlockTimes, BlockTimes]:
    """One sequence's F, B and W seconds of a block and of the head on one of `tp` ranks: the
    roofline on a GPU; on a CPU the FLOPs (Narayanan et al. 2021) at peak x efficiency, split by tp."""
    s, h, a, vocab = spec.seq, spec.hidden, spec.heads, spec.vocab
    gpu = dev.gpu
    if gpu is not None:
        heads_split = a % tp == 0
        block = block_times(s, h, a, gpu, tp if heads_split else 1)
        if not heads_split and tp > 1:  # the MLP alone splits: its 16 s h^2 of the 24 s h^2 + 4 s^2 h
            share = (16 * s * h * h) / (24 * s * h * h + 4 * s * s * h)
            block = BlockTimes(*(t * (1 - share + share / tp) for t in (block.forward_s, block.backward_s, block.weight_s)))
        return block, head_times(s, h, vocab, gpu, tp)
    speed = dev.flops
    split = (1.0 if a % tp == 0 else (16 * s * h * h) / (24 * s * h * h + 4 * s * s * h)) if tp > 1 else 0.0
    part = 1 - split + split / tp
    block = BlockTimes((24 * s * h * h + 4 * s * s * h) / speed * part, (24 * s * h * h + 8 * s * s * h) / speed * part,
                       24 * s * h * h / speed * part)
    head = 2 * s * h * vocab / speed / tp
    return block, BlockTimes(head, head, head)


def megatron_flops(spec: GptSpec, batch: int) -> float:
    """FLOPs of one training iteration of `batch` sequences as Megatron-LM counts them (Narayanan
    et al. 2021, equation 3: the forward recomputed in the backward, the logits' matmul):
    96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    s, l, h, v = spec.seq, spec.layers, spec.hidden, spec.vocab
    return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def key_values(text: str, flag: str, keys: Sequence[str], form: str) -> dict[str, str]:
    """`a=1,b=x` -> {"a": "1", "b": "x"}; an item that is not KEY=VALUE with a known KEY is an
    error naming it, the option (`flag`) and the accepted `form`."""
    given: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise ConfigError(f"cannot read {item!r} in {flag} {text!r}; write {form}")
        given[key.strip()] = value.strip()
    return given


def integer(flag: str, key: str, value: str) -> int:
    """`value` of `key` as an integer, or an error naming both and the option."""
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} {key}={value!r} is not an integer") from None


def parse_gpt(text: str) -> GptSpec:
    """`layers=48,hidden=8192,heads=64,seq=1024,vocab=51200` -> GptSpec (seq and vocab optional)."""
    given = key_values(text, "--gpt", ("layers", "hidden", "heads", "seq", "vocab"),
                       "layers=L,hidden=H,heads=A[,seq=S][,vocab=V]")
    values = {key: integer("--gpt", key, value) for key, value in given.items()}
    missing = [k for k in ("layers", "hidden", "heads") if k not in values]
    if missing:
        raise ConfigError(f"--gpt {text!r} lacks {', '.join(missing)}; for example "
                          "layers=24,hidden=1024,heads=16")
    return GptSpec(**values)


def gpt_costs(spec: GptSpec, dev: Device, optimizer: str = "adam") -> LayerCosts:
    """Per-layer `LayerCosts` of `spec` on `dev` (times per row = per sequence)."""
    if optimizer not in OPTIMIZER_TRAFFIC:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_TRAFFIC)}")
    s, h, a, vocab, d = spec.seq, spec.hidden, spec.heads, spec.vocab, dev.dtype_bytes
    overhead = dev.kernel_overhead_s
    block, head = _block_and_head(spec, dev, 1)
    embed_s = 2 * s * h * d / dev.bandwidth  # gather rows, add positions
    names = ["embedding"] + [f"block{i}" for i in range(spec.layers)] + ["head"]
    n = len(names)
    forward_row = [embed_s] + [block.forward_s] * spec.layers + [head.forward_s]
    backward_row = [0.0] + [block.backward_s] * spec.layers + [head.backward_s]  # ids: no input gradient
    weight_row = [embed_s] + [block.weight_s] * spec.layers + [head.weight_s]
    block_act = s * h * (34 + 5 * a * s / h) * d / 2
    head_act = 2 * s * h * d + s * vocab * (d + 4)  # normed input, logits, fp32 softmax
    params = [(vocab + s) * h] + [12 * h * h + 13 * h] * spec.layers + [vocab * h + 2 * h]
    traffic = OPTIMIZER_TRAFFIC[optimizer] / dev.bandwidth
    accumulate = 3 * d / dev.bandwidth  # a micro-batch's gradient added into the accumulated one
    return LayerCosts(
        names=tuple(names),
        forward_fixed_s=(overhead,) * n, forward_row_s=tuple(forward_row),
        backward_fixed_s=(overhead,) * n, backward_row_s=tuple(backward_row),
        weight_fixed_s=tuple(overhead + p * accumulate for p in params), weight_row_s=tuple(weight_row),
        activation_row_bytes=(float(s * h),) + (block_act,) * spec.layers + (head_act,),
        output_row_bytes=(float(s * h * d),) * (n - 1) + (float(s * vocab * d),),
        param_bytes=tuple(float(p * d) for p in params),
        grad_bytes=tuple(float(p * d) for p in params),
        optimizer_s=tuple(p * traffic for p in params),
        input_row_bytes=float(8 * s),  # int64 token ids
        source=f"analytic GPT (layers={spec.layers}, hidden={h}, heads={a}, seq={s}, "
               f"vocab={vocab}) on {dev.name}",
    )
