"""Small models the tests train: an MLP, the paper's CNN, a skip over two cuts, tuple-in/dict-out, a tied GPT."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def mlp(width: int = 16, depth: int = 6, classes: int = 4) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class PaperCNN(nn.Module):
    """conv3x3-32, conv3x3-64, maxpool 2, dropout, dense 128 ReLU, dropout, dense 10 (small input)."""

    def __init__(self, hw: int = 8, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.pool = nn.MaxPool2d(2)
        self.drop1 = nn.Dropout(0.25 if dropout else 0.0)
        self.fc1 = nn.Linear(64 * ((hw - 4) // 2) ** 2, 128)
        self.drop2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.drop1(self.pool(x))
        x = torch.flatten(x, 1)
        x = self.drop2(F.relu(self.fc1(x)))
        return self.fc2(x)


class Skip(nn.Module):
    """h = a(x) is used again after b, c, d: with 4 stages it crosses stages 1 and 2 untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(8, 8) for _ in range(5))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        z = self.d(torch.tanh(self.c(torch.tanh(self.b(h)))))
        return self.head(torch.tanh(self.e(z + h)))


class TupleDict(nn.Module):
    """Takes (x, scale) positionally, returns a dict with logits and an auxiliary tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(8, 12), nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.l1(x)) * scale
        aux = h.mean(dim=1)
        h = torch.relu(self.l2(h))
        h = torch.relu(self.l3(h)) + aux[:, None]
        return {"logits": self.l4(h), "aux": aux}


@dataclass
class GPTOutput:
    logits: torch.Tensor


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No bias on c_attn: the key bias has an identically zero gradient, and Adam turns the
        # rounding noise in it into full-size steps, so no two summation orders agree on it.
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """nanoGPT-shaped: token + position embeddings, blocks, final norm, LM head tied to wte."""

    def __init__(self, vocab: int = 32, block: int = 8, d: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> GPTOutput:
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        return GPTOutput(self.lm_head(self.ln_f(x)))


def gpt_loss(out: GPTOutput, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def make(name: str, seed: int = 0):
    """(net, x, y, loss) for a model name; the data is fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n = 23  # batch 10 -> batches of 10, 10, 3: uneven micro-batches and a short last batch
    if name == "mlp":
        return mlp(), torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g), nn.CrossEntropyLoss()
    if name == "cnn":
        return PaperCNN(), torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g), nn.CrossEntropyLoss()
    if name == "skip":
        return Skip(), torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g), nn.CrossEntropyLoss()
    if name == "tupledict":
        x = (torch.randn(n, 8, generator=g), torch.rand(n, 1, generator=g) + 0.5)
        return TupleDict(), x, torch.randint(0, 4, (n,), generator=g), lambda out, y: F.cross_entropy(out["logits"], y)
    if name == "gpt":
        idx = torch.randint(0, 32, (n, 8), generator=g)
        return TinyGPT(), idx, torch.roll(idx, -1, dims=1), gpt_loss
    raise KeyError(name)


MODELS = ["mlp", "cnn", "skip", "tupledict", "gpt"]
LAYERS = {"mlp": 11, "cnn": 7, "skip": 6, "tupledict": 4, "gpt": 16}  # captured layers of each


def even_cut(layers: int, parts: int) -> tuple[int, ...]:
    """`layers` layers in `parts` consecutive groups of sizes differing by at most one, larger
    ones last: Config(layers_per_stage=even_cut(...)) gives a test a fixed cut, where the
    planner's cut would follow the timings of the run (even_cut(6, 4) == (1, 1, 2, 2))."""
    base, extra = divmod(layers, parts)
    return tuple(base + (i >= parts - extra) for i in range(parts))
