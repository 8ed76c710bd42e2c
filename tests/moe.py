"""A mixture of experts whose routing depends on the data: torch.export cannot trace its router."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Top-1 routing: each row goes to the expert its gate scores highest, scaled by that score.

    `if rows.numel():` and `nonzero` make the control flow depend on the values: torch.export
    stops here (a data-dependent guard), and the rows per expert change from batch to batch.
    """

    def __init__(self, width: int = 8, experts: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, width)
        scores = torch.softmax(self.gate(x), dim=-1)  # (B, experts)
        choice = scores.argmax(dim=-1)  # (B,)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().flatten()
            if rows.numel():
                y = expert(x[rows]) * scores[rows, i : i + 1]  # (rows, width)
                out[rows] = F.dropout(y, self.dropout, self.training)
        return out + x


class MoENet(nn.Module):
    """a -> router -> b -> router2 -> head; the routers are kept whole, the rest is traced."""

    def __init__(self, width: int = 8, classes: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(width, width)
        self.moe1, self.moe2 = Router(width, dropout=dropout), Router(width, dropout=dropout)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 6)
        h = self.moe1(torch.tanh(self.a(x)))
        h = self.moe2(torch.tanh(self.b(h)))
        return self.head(h)  # (B, classes)
