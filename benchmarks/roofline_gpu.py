"""The planner's GPU roofline (`plait.cost.roofline`) against a real GPU, operator by operator.

Needs a CUDA device; CI never runs it. For each row of Megatron-LM's table (SC'21), one rank's
shard of its transformer block (tensor-parallel degree t: q|k|v and the first MLP linear by
columns, the output linears by rows, a/t heads; no collectives) is built in bf16 the way
Megatron-LM computes it (materialized attention scores, scale-mask-softmax, dropouts 0.1, GeLU),
compiled by `torch.compile` (which fuses the element-wise operators as Megatron-LM's fused
kernels do), and timed at the run script's micro-batch size: its forward, and its forward plus
backward (input and weight gradients), against `block_times` x micro-batch on a `Gpu` of the
data sheet's peak, the device's SMs, and the matmul rate and copy bandwidth this run measured
(below). Printed per row: measured, predicted and
measured / predicted; the block's GEMMs timed alone against `gemm_s`; and the rest (element-wise
and softmax) as block minus GEMMs against the roofline's bytes at the bandwidth.

Also measured, as the device's own constants (not fitted to the block): the best bf16 matmul rate
over a few large shapes (Bekman's MAMF method, shortened), the achieved copy bandwidth, and a layer
norm's forward and backward throughput (PyTorch's kernel, at the shape of apex's A100 figure,
16384 x 1024, and at a Megatron row's, 4096 x 12288, which the roofline takes).

    python benchmarks/roofline_gpu.py [--peak-tflops 989] [--bandwidth-tbs 4.8] [--rows 4]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from torch import nn

from plait.cost.roofline import Gpu, block_times, gemm_s, memory_s
from plait.cli.gpu_probe import ProbeSizes, best_matmul, copy_bandwidth, norm_throughput, timed

# name, hidden, heads, t, the run script's micro-batch size (examples/sc21/run_table_1.sh)
ROWS = [("1.7B", 2304, 24, 1, 16), ("18.4B", 6144, 48, 8, 8), ("39.1B", 8192, 64, 8, 4),
        ("145.6B", 12288, 96, 8, 2), ("1008B", 25600, 160, 8, 1)]
SEQ = 2048


class BlockShard(nn.Module):
    """One of t ranks' share of a Megatron-LM transformer block, on (seq, batch, hidden) inputs."""

    def __init__(self, hidden: int, heads: int, t: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.head_dim, self.p = heads // t, hidden // heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden // t)
        self.proj = nn.Linear(hidden // t, hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden // t)
        self.fc2 = nn.Linear(4 * hidden // t, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        n, d = self.heads, self.head_dim
        q, k, v = self.qkv(self.ln1(x)).view(s, b * n, 3 * d).transpose(0, 1).split(d, dim=-1)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = nn.functional.dropout(scores.masked_fill(causal, -10000.0).softmax(-1), self.p)
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, n * d)
        x = x + nn.functional.dropout(self.proj(context), self.p)
        return x + nn.functional.dropout(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))), self.p)


def device_of(smoke: bool) -> tuple[bool, torch.device, torch.dtype]:
    """Where a GPU benchmark runs: CUDA in bf16 where there is a device and not `smoke`, else the
    CPU in fp32."""
    cuda = torch.cuda.is_available() and not smoke
    return cuda, torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32


def block_gemms(s: int, b: int, h: int, a: int, t: int) -> list[tuple[int, int, int, int]]:
    """The block's forward GEMMs (M, N, K, batch) on one of t ranks, as the roofline prices them."""
    n, d = a // t, h // a
    return [(s * b, 3 * h // t, h, 1), (s * b, h, h // t, 1), (s * b, 4 * h // t, h, 1),
            (s * b, h, 4 * h // t, 1), (s, s, d, b * n), (s, d, s, b * n)]


def operators(row: str, seq: int, b: int, h: int, a: int, t: int, gpu: Gpu, dev: torch.device,
              dtype: torch.dtype, reps: int, compile_: bool) -> None:
    """Each of the block's GEMMs (forward, input- and weight-gradient shapes) and fused element-wise
    operators timed alone against the roofline's time for it; the element-wise ones also as the
    bandwidth they reached."""
    n, d = a // t, h // a
    e = 2  # bytes of bf16
    print(f"-- {row}: t={t}, micro-batch {b}: operator, measured ms, roofline ms, ratio (bandwidth reached)")
    names = ["qkv", "proj", "fc1", "fc2"]
    for name, (m, nn_, k, batch) in zip(names + ["q k^T", "probs v"], block_gemms(seq, b, h, a, t)):
        shapes = [("fwd", m, nn_, k), ("dgrad", m, k, nn_), ("wgrad", k, nn_, m)] if batch == 1 else [("fwd", m, nn_, k)]
        for kind, mm, nn2, kk in shapes:
            left = torch.randn(batch, mm, kk, device=dev, dtype=dtype)
            right = torch.randn(batch, kk, nn2, device=dev, dtype=dtype)
            took = timed(lambda: torch.bmm(left, right), reps, dev)
            pred = gemm_s(mm, nn2, kk, gpu, batch)
            rate = 2.0 * mm * nn2 * kk * batch / took / 1e12
            print(f"   {name:>8} {kind:>5} {mm}x{nn2}x{kk} x{batch}: {took * 1e3:8.3f} {pred * 1e3:8.3f} {took / pred:6.3f}"
                  f"  ({rate:.0f} TFLOP/s)")
        del left, right
    wrap = torch.compile if compile_ else (lambda f: f)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).triu(1)
    x = torch.randn(seq, b, h, device=dev, dtype=dtype)
    wide = torch.randn(seq, b, 4 * h // t, device=dev, dtype=dtype)
    bias_h, bias_w = torch.randn(h, device=dev, dtype=dtype), torch.randn(4 * h // t, device=dev, dtype=dtype)
    scores = torch.randn(b * n, seq, seq, device=dev, dtype=dtype)
    norm = nn.LayerNorm(h).to(dev, dtype)
    cases = [
        ("layer norm", wrap(lambda: norm(x)), 2 * seq * b * h * e),
        ("softmax", wrap(lambda: scores.softmax(-1)), 2 * b * n * seq * seq * e),
        ("scale-mask-softmax", wrap(lambda: (scores * 0.1).masked_fill(causal, -1e4).softmax(-1)), 2 * b * n * seq * seq * e),
        ("dropout(probs)", wrap(lambda: nn.functional.dropout(scores, 0.1)), b * n * seq * seq * (2 * e + 1)),
        ("softmax+dropout", wrap(lambda: nn.functional.dropout((scores * 0.1).masked_fill(causal, -1e4).softmax(-1), 0.1)),
         b * n * seq * seq * (4 * e + 1)),
        ("bias-GeLU", wrap(lambda: nn.functional.gelu(wide + bias_w)), 2 * seq * b * 4 * h // t * e),
        ("bias-dropout-add", wrap(lambda: x + nn.functional.dropout(x + bias_h, 0.1)), seq * b * h * (3 * e + 1)),
    ]
    for name, fn, nbytes in cases:
        took = timed(fn, reps, dev)
        pred = memory_s(nbytes, gpu)
        print(f"   {name:>18}: {took * 1e3:8.3f} {pred * 1e3:8.3f} {took / pred:6.3f}  ({nbytes / took / 1e12:.2f} TB/s)")


def block_row(row: str, seq: int, mbs: int, h: int, a: int, t: int, with_mamf: Gpu, dev: torch.device,
              dtype: torch.dtype, reps: int, cuda: bool) -> None:
    """One row's block shard, compiled, timed forward and forward plus backward against the roofline,
    with its GEMMs alone and the rest."""
    block = BlockShard(h, a, t).to(dev, dtype)
    x = torch.randn(seq, mbs, h, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    run = torch.compile(block) if cuda else block

    def forward() -> None:
        run(x)

    def forward_backward() -> None:
        run(x).backward(grad)

    fwd, both = timed(forward, reps, dev), timed(forward_backward, reps, dev)
    gemm_measured = gemm_pred = 0.0
    for m, n, k, batch in block_gemms(seq, mbs, h, a, t):
        left = torch.randn(batch, m, k, device=dev, dtype=dtype)
        right = torch.randn(batch, k, n, device=dev, dtype=dtype)
        gemm_measured += timed(lambda: torch.bmm(left, right), reps, dev)
        gemm_pred += gemm_s(m, n, k, with_mamf, batch)
    times = block_times(seq, h, a, with_mamf, t)
    pred_fwd = times.forward_s * mbs
    pred_both = (times.forward_s + times.backward_s + times.weight_s) * mbs
    # the roofline's non-GEMM forward: its block forward less its GEMMs priced per sequence
    per_seq = block_gemms(seq, 1, h, a, t)
    rest_pred = pred_fwd - mbs * sum(gemm_s(m, n, k, with_mamf, batch) for m, n, k, batch in per_seq)
    rest = fwd - gemm_measured
    print(f"{row:>7} {t:>2} {mbs:>3} | {fwd * 1e3:8.3f} {pred_fwd * 1e3:8.3f} {fwd / pred_fwd:6.3f} | "
          f"{both * 1e3:8.3f} {pred_both * 1e3:8.3f} {both / pred_both:6.3f} | {gemm_measured * 1e3:8.3f} "
          f"{gemm_pred * 1e3:8.3f} {gemm_measured / gemm_pred:6.3f} | {rest * 1e3:8.3f} {rest_pred * 1e3:8.3f} "
          f"{rest / rest_pred:6.3f}")
    del block, x, grad, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="data sheet's dense bf16 peak (H100/H200 SXM)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="data sheet's HBM bandwidth (H200: 4.8)")
    parser.add_argument("--rows", type=int, default=len(ROWS), help="the table's first ROWS rows")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--detail", default="", help="comma-separated rows (e.g. 1.7B,39.1B) to time operator by operator")
    parser.add_argument("--detail-only", action="store_true", help="time the --detail rows' operators, not the blocks")
    parser.add_argument("--eager", action="store_true",
                        help="--detail's element-wise operators as PyTorch's own kernels (not compiled)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in fp32 (checks the script)")
    args = parser.parse_args()
    cuda, dev, dtype = device_of(args.smoke)
    scale = 1 if cuda else 32  # --smoke: hidden, sequence and heads cut down
    seq = SEQ // scale
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        props = torch.cuda.get_device_properties(dev)
        sms, name = props.multi_processor_count, props.name
        print(f"device: {name}, {sms} SMs, torch {torch.__version__}")
    else:
        sms, name = 8, "cpu"
    probe = ProbeSizes()  # the shapes and copy `plait device` measures, cut down on the CPU
    sizes = probe.matmuls if cuda else ((256, 256, 256),)
    measured, shape = best_matmul(dev, dtype, sizes, args.reps)
    copy_bw = copy_bandwidth(dev, probe.copy_bytes if cuda else 2**22, args.reps)
    norms = {shape_: norm_throughput(*shape_, dev, dtype, args.reps)
             for shape_ in ([(16384, 1024), (4096, 12288)] if cuda else [(512, 64)])}
    norm_bw = list(norms.values())[-1]  # at a Megatron row's 4096 tokens x 12288
    data_sheet = Gpu(args.peak_tflops * 1e12, sms, args.bandwidth_tbs * 1e12, dtype_bytes=2)
    with_mamf = Gpu(args.peak_tflops * 1e12, sms, args.bandwidth_tbs * 1e12, 2, measured, shape, copy_bw, norm_bw)
    print(f"best matmul: {measured / 1e12:.1f} TFLOP/s at {shape} ({measured / data_sheet.peak_flops:.3f} of peak); "
          f"copy: {copy_bw / 1e12:.2f} TB/s ({copy_bw / data_sheet.memory_bandwidth:.3f} of the data sheet)")
    print("layer norm (PyTorch's kernel): " + "; ".join(
        f"{r} x {c}: forward {f / 1e12:.2f} TB/s, backward {b / 1e12:.2f} TB/s" for (r, c), (f, b) in norms.items()))
    print("Roofline on the data sheet's peak with the best matmul, the copy bandwidth and the last layer norm above;"
          " ratio = measured / predicted")
    print(f"{'row':>7} {'t':>2} {'mbs':>3} | {'fwd ms':>8} {'pred':>8} {'ratio':>6} | {'f+b ms':>8} {'pred':>8} "
          f"{'ratio':>6} | {'GEMMs ms':>8} {'pred':>8} {'ratio':>6} | {'rest ms':>8} {'pred':>8} {'ratio':>6}")
    for row, hidden, heads, t, mbs in ROWS[: args.rows]:
        h, a = hidden // scale, max(heads // scale, t)
        torch.manual_seed(0)
        if not args.detail_only:
            block_row(row, seq, mbs, h, a, t, with_mamf, dev, dtype, args.reps, cuda)
        if row in args.detail.split(","):
            operators(row, seq, mbs, h, a, t, with_mamf, dev, dtype, args.reps, cuda and not args.eager)
        if cuda:
            torch.cuda.empty_cache()
    print(f"(memory_s of 1 GiB at the data sheet: {memory_s(2**30, data_sheet) * 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
