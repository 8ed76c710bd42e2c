"""The one-process references of mixed precision, by hand in plain PyTorch: a low-precision copy of the model
computes each micro-batch and fp32 master weights step (tests/test_precision.py says how and why)."""

from __future__ import annotations

import copy

import torch
from torch import nn

LR = 0.1


def sgd(params):
    # SGD keeps each update proportional to its gradient, so a difference measures the gradients
    # (Adam's first steps are about lr * sign(g): any gradient near 0 turns into a full lr step)
    return torch.optim.SGD(params, lr=LR)


def copies(net: nn.Module, dtype, untie: bool):
    """(fp32 master, `dtype` copy, [(copy parameter, master parameter)]): the copy's parameters in
    `dtype`, its buffers as they are (FSDP2's policy casts parameters only: Llama's rotary inv_freq
    stays fp32; rounded to bf16 it would move every logit).

    A weight tied across stages (`untie`: the embedding and the LM head, on the first stage and
    the last) has one copy on each stage's rank, and each copy's gradient is added into the fp32
    master on its own -- as Megatron sums the embedding's gradients in fp32. So the copy here unties
    it: each module that holds it gets a copy of its own, and both gradients are added into the one
    master. On one stage, the one copy's gradient sums both uses in low precision, as without `untie`."""
    master = copy.deepcopy(net)
    low = copy.deepcopy(net)
    for p in low.parameters():
        p.data = p.data.to(dtype)
    pairs, seen = [], set()  # (copy, master) for every module's own parameter entry
    for (_, mm), (_, lm) in zip(master.named_modules(remove_duplicate=False), low.named_modules(remove_duplicate=False)):
        for name, mp in mm._parameters.items():
            lp = lm._parameters[name]
            if mp is None:
                continue
            if id(lp) in seen and untie:  # tied: this module's own copy
                lp = lm._parameters[name] = nn.Parameter(lp.detach().clone())
            if id(lp) not in seen:
                pairs.append((lp, mp))
            seen.add(id(lp))
    return master, low, pairs


def microbatch(low: nn.Module, pairs, x, y, loss, part: slice, dtype, scaled=lambda value: value) -> None:
    """One micro-batch's backward on the copy (its loss times its share of the rows, then `scaled`:
    GradScaler's scale), its gradients added into the masters' fp32 ones."""
    xb = {k: v[part].to(dtype) if v.is_floating_point() else v[part] for k, v in x.items()}
    out = low(**xb)
    out.logits = out.logits.float()
    scaled(loss(out, y[part]) * (len(y[part]) / len(y))).backward()
    for pl, pm in pairs:
        if pl.grad is not None:
            pm.grad = pl.grad.float() if pm.grad is None else pm.grad + pl.grad.float()
            pl.grad = None


def by_hand(net: nn.Module, x, y, loss, steps: int, rows_per_microbatch: int, dtype, untie: bool) -> nn.Module:
    """The one-process reference: a `dtype` copy computes each micro-batch, fp32 masters step."""
    master, low, pairs = copies(net, dtype, untie)
    return _stepped(master, low, pairs, x, y, loss, steps, rows_per_microbatch, dtype)


def _stepped(master: nn.Module, low: nn.Module, pairs, x, y, loss, steps: int, rows_per_microbatch: int, dtype,
             before_step=lambda: None) -> nn.Module:
    """`steps` SGD steps of the masters, the copy refreshed before each and computing its micro-batches;
    `before_step()` after the last micro-batch of each step."""
    opt = sgd(master.parameters())
    for _ in range(steps):
        with torch.no_grad():
            for pl, pm in pairs:
                pl.copy_(pm)
        for start in range(0, len(y), rows_per_microbatch):
            microbatch(low, pairs, x, y, loss, slice(start, start + rows_per_microbatch), dtype)
        before_step()
        opt.step()
        opt.zero_grad()
    return master


def by_hand_fp16(net: nn.Module, x, y, loss, steps: int, rows_per_microbatch: int, untie: bool,
                 init_scale: float) -> tuple[nn.Module, list[float]]:
    """fp16 by hand with torch.amp.GradScaler (its defaults but `init_scale`): the scaled loss's
    gradients added into the fp32 masters, `scaler.step` unscaling them (or skipping), `update`.
    The masters and the scale after each step."""
    master, low, pairs = copies(net, torch.float16, untie)
    opt = sgd(master.parameters())
    scaler, scales = torch.amp.GradScaler("cpu", init_scale=init_scale), []
    for _ in range(steps):
        with torch.no_grad():
            for pl, pm in pairs:
                pl.copy_(pm)
        for start in range(0, len(y), rows_per_microbatch):
            microbatch(low, pairs, x, y, loss, slice(start, start + rows_per_microbatch), torch.float16,
                       scaler.scale)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return master, scales


def fp32(net: nn.Module, x, y, loss, steps: int) -> nn.Module:
    """fp32 training of the same model (what bf16 must be far from)."""
    master = copy.deepcopy(net)
    opt = sgd(master.parameters())
    for _ in range(steps):
        loss(master(**x), y).backward()
        opt.step()
        opt.zero_grad()
    return master


class _KeptLinear(torch.autograd.Function):
    """F.linear whose backward gives the input's gradient and keeps (x, dy) for the step's fp32 weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(x, weight)
        ctx.kept = kept
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        ctx.kept.append((x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])))
        return grad_y.matmul(weight), None, None, None


def fused_by_hand(net: nn.Module, x, y, loss, steps: int, rows_per_microbatch: int, dtype, untie: bool) -> nn.Module:
    """One process, a `dtype` copy computing each micro-batch, each unshared linear's weight gradient in fp32."""
    master, low, pairs = copies(net, dtype, untie)
    master_of = {id(pl): pm for pl, pm in pairs}
    entries: dict[int, int] = {}
    for m in low.modules():
        for p in m._parameters.values():
            if p is not None:
                entries[id(p)] = entries.get(id(p), 0) + 1
    kept: dict[nn.Linear, list] = {}
    for m in low.modules():
        if isinstance(m, nn.Linear) and entries[id(m.weight)] == 1:
            kept[m] = []
            m.forward = lambda inp, m=m: _KeptLinear.apply(inp, m.weight, m.bias, kept[m])

    def weight_gradients() -> None:  # each kept linear's, over every micro-batch's rows, in fp32
        for m, pairs_kept in kept.items():
            xs, gys = torch.cat([a for a, _ in pairs_kept]).float(), torch.cat([b for _, b in pairs_kept]).float()
            for p, grad in ((m.weight, gys.t().mm(xs)), (m.bias, gys.sum(0) if m.bias is not None else None)):
                if p is not None:
                    pm = master_of[id(p)]
                    pm.grad = grad if pm.grad is None else pm.grad + grad
            pairs_kept.clear()

    return _stepped(master, low, pairs, x, y, loss, steps, rows_per_microbatch, dtype, weight_gradients)
