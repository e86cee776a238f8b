"""A tensor tied between stages (a token embedding reused as the LM head) is held once by a
device its stages share, and once by each device otherwise (issue 33 item 2): tune's static
bytes (parameters, buffers, gradients, optimizer state) count it so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.build import BuildOptions, capture_and_check
from fxpipe.capture._prepare import preserved
from fxpipe.plan._make import make_plan
from fxpipe.tuning._tensors import once_per_device, stage_tensors

VOCAB, WIDTH = 64, 32


class TiedLM(nn.Module):
    """Embedding, two blocks, and a head whose weight is the embedding's; a buffer too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("shift", torch.zeros(WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)) + self.shift)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(0))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_one_process_counts_a_tied_weight_once() -> None:
    """Two stages on the CPU share the embedding: once in the parameters, its gradient and
    Adam's two moments, as ``model.parameters()`` (which lists it once) has it."""
    torch.manual_seed(0)
    model = TiedLM()
    t = fxpipe.tune(model, _tokens(), ["cpu"] * 2, schedules=("gpipe",), chunks=[1], checkpoint=("never",),
                    optimizer="adam", balance_by="params")
    plan = t.best.plan
    embed_stage = {plan.assignment[n] for n in plan.assignment if n.startswith("embed")}
    head_stage = {plan.assignment[n] for n in plan.assignment if n.startswith("head")}
    assert embed_stage == {0} and head_stage == {1}, plan  # the tie crosses the stages
    held = _bytes(model.parameters()) + _bytes(model.buffers())
    trained = _bytes(model.parameters())
    assert t.best.static_bytes["cpu"] == held + 3 * trained


@pytest.mark.parametrize("devices, counted", [([0, 0, 0, 0], 1), ([0, 1, 1, 0], 1), ([0, 1, 2, 3], 2),
                                              ([0, 0, 1, 1], 2)])
def test_a_tensor_counts_once_per_device_holding_it(devices: list, counted: int) -> None:
    """Four stages, the embedding in the first and the head in the last: on one device, or
    the V of ``zbv`` (stages 0 and 3 on rank 0), the tie is one tensor; on two devices, two."""
    torch.manual_seed(0)
    model, tokens = TiedLM(), _tokens()
    with preserved(model):
        checked = capture_and_check(model, (tokens,), {}, BuildOptions(4, balance_by="params"))
        plan = make_plan(checked.capture, checked.args, checked.kwargs, 4, balance_by="params",
                         batching=checked.batching, progress=False)
    tensors = stage_tensors(checked.capture.graph_module, plan)
    tie = id(model.embed.weight)
    assert tie in tensors[0] and tie in tensors[3], plan
    held, trained = once_per_device(tensors, devices)
    tied = _bytes([model.embed.weight])
    everything = _bytes(model.parameters()) + _bytes(model.buffers())
    assert sum(held) == everything + (counted - 1) * tied
    assert sum(trained) == _bytes(model.parameters()) + (counted - 1) * tied
    # the last stage holds the head's weight only where stage 0 is on another device
    assert (tied <= held[3]) == (devices[3] != devices[0])
