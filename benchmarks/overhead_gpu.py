"""The fixed time of a transformer layer's pass on a GPU, and the gradient accumulation's bandwidth.

Needs a CUDA device; CI never runs it (`--smoke` checks the script on the CPU). What the GPU presets'
`kernel_overhead_s` (a fixed time per layer and pass, beside the roofline's operators) and the
gradient accumulation's bytes stand for, measured:

1. the kernel gap: the GPU time of one trivial kernel (an add to one element) launched back to back
   while the host is ahead of the GPU (a `torch.cuda._sleep` queued first, so the launches wait in
   the stream and the host's own dispatch time is hidden, as it is behind a large model's kernels);
2. the kernels of one pass: the CUDA kernels of a Megatron-style block (`roofline_gpu.BlockShard`,
   eager, bf16) counted by `torch.profiler` over a forward and over a forward plus backward;
3. the block at a tiny size (hidden 256, 128 tokens) timed per pass with the host ahead (the GPU's
   side: the kernels' gaps and their least durations) and without (the host's dispatch per pass);
4. the gradient accumulation: `main_grad.add_(grad)` as Megatron-LM's DDP hook runs it once per
   micro-batch (fp16, 6 bytes per parameter: both read, one written), at one rank's share of a
   block of each Megatron table row, as bytes per second beside a copy's.

    python benchmarks/overhead_gpu.py [--reps 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline_gpu import ROWS, BlockShard, device_of  # noqa: E402

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from plait.cli.gpu_probe import SLEEP_CYCLES, ProbeSizes, copy_bandwidth, host_ahead_s, timed  # noqa: E402


def sleep_s(cuda: bool) -> float:
    """Seconds the GPU's sleep kernel of `host_ahead_s` lasts (the host stayed ahead of the GPU
    where it queued a timing's calls within it); 0 on the CPU."""
    if not cuda:
        return 0.0
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    last.record()
    last.synchronize()
    return first.elapsed_time(last) / 1e3


def kernels(fn, cuda: bool) -> int:
    """CUDA kernels (and memsets, copies) one call of `fn` launches, by the profiler."""
    if not cuda:
        return 0
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="on the CPU in fp32 (checks the script)")
    args = parser.parse_args()
    cuda, dev, dtype = device_of(args.smoke)
    if cuda:
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")

    one = torch.zeros(1, device=dev)
    n = 10 * args.reps
    gap, host = host_ahead_s(lambda: one.add_(1.0), n, dev)
    print(f"trivial kernel back to back, host ahead: {gap * 1e6:.2f} us a kernel on the GPU; "
          f"host {host * 1e6:.2f} us a launch; {n} launches queued in {host * n * 1e3:.1f} ms "
          f"behind a {sleep_s(cuda) * 1e3:.0f} ms sleep")

    torch.manual_seed(0)
    hidden, heads, seq = 256, 4, 128
    block = BlockShard(hidden, heads, 1).to(dev, dtype)
    x = torch.randn(seq, 1, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def forward() -> None:
        block(x)

    def forward_backward() -> None:
        block(x).backward(grad)

    k_f, k_fb = kernels(forward, cuda), kernels(forward_backward, cuda)
    # CUDA's launch queue holds about a thousand launches: beyond it the host waits for the GPU
    reps = max(1, min(args.reps, 900 // max(k_fb, 1)))
    f_gpu, f_host = host_ahead_s(forward, reps, dev)
    fb_gpu, fb_host = host_ahead_s(forward_backward, reps, dev)
    print(f"block of hidden {hidden}, {heads} heads, {seq} tokens (eager, {dtype}): kernels forward {k_f}, "
          f"backward {k_fb - k_f}; {reps} passes queued")
    print(f"   GPU per pass with the host ahead: forward {f_gpu * 1e6:.1f} us, backward {(fb_gpu - f_gpu) * 1e6:.1f} us")
    print(f"   host per pass (dispatch):         forward {f_host * 1e6:.1f} us, backward {(fb_host - f_host) * 1e6:.1f} us")
    if cuda:
        per_pass = (k_fb * gap) / 3
        print(f"   kernels x gap: forward {k_f * gap * 1e6:.1f} us, backward {(k_fb - k_f) * gap * 1e6:.1f} us; "
              f"over the three passes (F, B, W) {per_pass * 1e6:.1f} us a pass")

    copy_bw = copy_bandwidth(dev, ProbeSizes().copy_bytes if cuda else 2**22, 10)
    print(f"copy: {copy_bw / 1e12:.2f} TB/s (read + written)")
    for name, h, _, t, _ in ROWS:
        params = 12 * h * h // t if cuda else 12 * (h // 32) ** 2
        main_grad = torch.zeros(params, device=dev, dtype=torch.float16)
        new = torch.randn(params, device=dev, dtype=torch.float16)
        took = timed(lambda: main_grad.add_(new), 10, dev)
        print(f"   {name:>7} t={t}: {params / 1e6:7.1f} M parameters a block a rank, main_grad.add_(grad) "
              f"{took * 1e3:7.3f} ms = {6 * params / took / 1e12:.2f} TB/s ({6 * params / took / copy_bw:.2f} of the copy)")
        del main_grad, new
    return 0


if __name__ == "__main__":
    sys.exit(main())
