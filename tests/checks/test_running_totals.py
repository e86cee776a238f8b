"""A running total over the batch's samples that a threshold decides on (an expert capacity
counted over the flattened batch) is refused at the build; along a sample's own dims it is
exact (:mod:`fxpipe.checks._running_totals`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from exact import assert_exact
from fxpipe.errors import MicroBatchError


class CapacityMoE(nn.Module):
    """Top-1 routing with token dropping: a token is kept while its slot in its expert's queue
    is within the capacity. ``per_sample``: the queue and the capacity per sample (Switch
    Transformers); else over the flattened batch (GShard)."""

    def __init__(self, per_sample: bool, through_export: bool = False, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.per_sample, self.through_export, self.experts = per_sample, through_export, experts
        self.inp, self.out = nn.Linear(8, d), nn.Linear(d, 3)
        self.router = nn.Linear(d, experts, bias=False)
        self.expert = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_export and x.shape[1] > 1:  # a branch on a size: torch.fx cannot trace it
            x = x * 1.0
        h = torch.tanh(self.inp(x))
        b, t, _ = h.shape
        gate, index = self.router(h).softmax(-1).max(-1)
        onehot = F.one_hot(index, self.experts).to(h.dtype)
        if self.per_sample:
            capacity, slot = math.ceil(2.0 * t / self.experts), onehot.cumsum(1) * onehot
        else:
            capacity = math.ceil(2.0 * b * t / self.experts)
            slot = onehot.reshape(b * t, self.experts).cumsum(0).reshape(b, t, self.experts) * onehot
        keep = ((slot > 0) & (slot <= capacity)).to(h.dtype).sum(-1)
        mixed = sum(onehot[..., e:e + 1] * layer(h) for e, layer in enumerate(self.expert))
        return self.out(h + mixed * (gate * keep).unsqueeze(-1))


@pytest.mark.parametrize("through_export", [False, True])
def test_a_capacity_counted_over_the_batch_is_refused_naming_the_line(through_export):
    """A trial: built, exact on the sample (no expert overflowed), 0.185 off once routing skewed."""
    torch.manual_seed(0)
    model = CapacityMoE(per_sample=False, through_export=through_export)
    with pytest.raises(MicroBatchError, match=r"test_running_totals.py.*`cumsum` along dim 0 is a running total "
                                              r"over the batch's samples.*chunks=1"):
        fxpipe.pipeline(model, torch.randn(8, 8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)


@pytest.mark.parametrize("through_export", [False, True])
def test_a_capacity_per_sample_is_exact(through_export):
    torch.manual_seed(0)
    pipe = assert_exact(CapacityMoE(per_sample=True, through_export=through_export), (torch.randn(8, 8, 8),), 2,
                        chunks=2, balance_by="params")
    assert pipe.capture.method == ("export" if through_export else "fx")


class MaskPositions(nn.Module):
    """Positions from a left-padded mask: a running total along the sequence, then clamped."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(20, 16), nn.Embedding(12, 16), nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids) + self.positions((mask.cumsum(-1) - 1).clamp(min=0)))


def test_positions_counted_along_the_sequence_are_exact():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 20, (4, 10)), torch.ones(4, 10, dtype=torch.long)
    mask[0, :3] = 0
    assert_exact(MaskPositions(), (ids, mask), 2, chunks=2, balance_by="params")


class DroplessDispatch(nn.Module):
    """A dropless MoE's dispatch: each token's slot in its expert's buffer is a running total over
    the flattened batch, picked by ``torch.where`` as a position, not decided on."""

    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.inp, self.router, self.out = nn.Linear(8, d), nn.Linear(d, experts, bias=False), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        b, t, d = h.shape
        flat = h.reshape(b * t, d)
        onehot = F.one_hot(self.router(flat).argmax(-1), self.experts).to(flat.dtype)
        slot = onehot.cumsum(0) - 1
        position = torch.where(onehot > 0, slot, torch.zeros_like(slot)).sum(-1)
        return self.out(h + 0 * position.reshape(b, t, 1))


def test_a_running_total_used_as_a_position_is_exact():
    """Refused while `where` counted as a threshold (a review: a dropless dispatch and packed
    offsets, exact before); only a comparison or clamp of the total decides on it."""
    torch.manual_seed(0)
    assert_exact(DroplessDispatch(), (torch.randn(8, 8, 8),), 2, chunks=2, balance_by="params")
