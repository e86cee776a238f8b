"""A model whose later stages receive values that need no gradient (issue 33), and the probes
that record what they receive: shared by tests/test_portal_requires_grad.py (one process)
and tests/distributed/test_distributed_requires_grad.py (gloo ranks)."""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

import torch
from torch import nn


class Probe(nn.Module):
    """Records, under its tag, whether the value it is handed requires grad (kept opaque,
    so it runs inside the stage that received the value)."""

    def __init__(self, log: List[Tuple[str, bool]], tag: str) -> None:
        super().__init__()
        self.log, self.tag = log, tag

    def forward(self, v: Any) -> Any:
        for k, t in enumerate(v if isinstance(v, tuple) else (v,)):
            self.log.append((f"{self.tag}[{k}]" if isinstance(v, tuple) else self.tag, t.requires_grad))
        return v


class SkipNet(nn.Module):
    """Four blocks; split before ``b``, ``c`` and ``d``, the input ``x`` skips to the head
    (over two stages with four stages), ``s = x * scale`` (buffers only) crosses a
    boundary to stage 1 and a portal to the head, and a tuple ``(x, h)`` mixes a leaf that
    needs no gradient with one that does."""

    def __init__(self, log: List[Tuple[str, bool]]) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8 + 4 + 4 + 8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))
        self.p_boundary = Probe(log, "buffer-derived at the boundary")
        self.p_x = Probe(log, "input at the head")
        self.p_s = Probe(log, "buffer-derived at the head")
        self.p_pair = Probe(log, "(input, activation) at the head")
        self.p_h = Probe(log, "activation at the head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x * self.scale
        h0 = torch.relu(self.a(x))
        pair = (x, h0)
        h = torch.relu(self.b(h0))
        h = h + self.p_boundary(s).sum(1, keepdim=True)
        h = torch.relu(self.c(h))
        h = torch.relu(self.d(h))
        xx, hh = self.p_pair(pair)
        cat = torch.cat([self.p_h(h), self.p_x(x), self.p_s(s) + xx, hh], dim=1)
        return self.head(cat)


#: split points per stage count: with 4 stages x and s skip stages 1 and 2 to reach the head
SPLITS = {2: ["d"], 3: ["b", "d"], 4: ["b", "c", "d"]}


def flags_of(log: List[Tuple[str, bool]]) -> Dict[str, Set[bool]]:
    """Per probe tag, the ``requires_grad`` values it saw (in every forward and recomputation)."""
    flags: Dict[str, Set[bool]] = {}
    for tag, needs in log:
        flags.setdefault(tag, set()).add(needs)
    return flags
