"""Structured values crossing stages keep every gradient (issue #8, item 1).

A leaf module returning a ``ModelOutput``, a plain dataclass, a namedtuple or a ``split``
result hands its tensors to the next stage inside a container. Checkpoint/Recompute,
Copy/Wait, portals and gather must all find those tensors (one pytree mechanism,
``fxpipe.tree``), or the producer's parameters get no gradient.
"""

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from exact import assert_exact

MODES = ["always", "except_last", "never"]


def _model_output(h):
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=h)


@dataclasses.dataclass
class Plain:  # not registered with pytree
    hidden: torch.Tensor
    scale: float = 1.0


class Pair(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


class Producer(nn.Module):
    """An opaque leaf returning its result wrapped in a container."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.kind == "model_output":
            return _model_output(h)
        if self.kind == "dataclass":
            return Plain(h, 2.0)
        if self.kind == "namedtuple":
            return Pair(h, torch.sigmoid(h))
        return h.split(4, dim=1)


def _hidden(value, kind):
    if kind == "model_output":
        return value.last_hidden_state
    if kind == "dataclass":
        return value.hidden * value.scale
    if kind == "namedtuple":
        return value.hidden * value.gate
    return torch.cat(value, 1)


class Net(nn.Module):
    """``prod``'s container is used by the next stage and, through a portal, by the last."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.prod = Producer(kind)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)

    def forward(self, x):
        p = self.prod(x)
        h = self.c(torch.relu(self.b(_hidden(p, self.kind))))
        return self.d(h) + _hidden(p, self.kind)


KINDS = ["model_output", "dataclass", "namedtuple", "split"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_container_crossing_a_cut_and_a_portal(kind, mode, chunks):
    if kind == "model_output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Net(kind)
    x = torch.randn(6, 8)
    # stage 0: prod; stage 1: b, c (the container crosses to it); stage 2: d (by portal)
    pipe = assert_exact(model, (x,), 3, chunks=chunks, checkpoint=mode, leaf_modules=[Producer],
                        split_points=["b", "d"])
    assert pipe.plan.portals, "the container must also travel through a portal"


class OutputsContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.prod = Producer("model_output")
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        p = self.prod(x)
        return _model_output(self.head(p.last_hidden_state))


@pytest.mark.parametrize("mode", MODES)
def test_model_output_is_the_pipeline_output(mode):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    pipe = assert_exact(OutputsContainer(), (torch.randn(4, 8),), 2, chunks=2, checkpoint=mode,
                        leaf_modules=[Producer])
    out = pipe(torch.randn(4, 8))
    assert type(out).__name__ == "BaseModelOutput"


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), self.c(self.b(x))


@pytest.mark.parametrize("mode", MODES)
def test_unused_first_output_keeps_grad_none(mode):
    """The first float output of a checkpointed stage carries no phony joins in generated
    code, so a parameter used only by an output the loss ignores keeps grad None, as eager."""
    torch.manual_seed(0)
    model = TwoHeads()
    pipe = assert_exact(model, (torch.randn(4, 8),), 2, chunks=2, checkpoint=mode, split_points=["c"],
                        loss=lambda out: out[1].sum())
    assert pipe.module.a.weight.grad is None
