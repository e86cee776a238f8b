"""The loss after the model, measured per loss (issue 33): a cross entropy over wide logits
keeps its ``log_softmax`` and makes two more copies in its backward; ``pow(2).mean()`` keeps
the output and makes about three. The merged output itself lives through the backward, as the
guide's loop (``out = pipe(x)``) keeps it.

Measured as ``tests/tuning/test_peak_measured.py`` does (the CPU allocator's records).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.tuning._loss_memory import measure_loss_memory
from tests.tuning.test_peak_measured import _rise


def test_what_the_loss_keeps_is_measured() -> None:
    head = nn.Linear(16, 512)
    x = torch.randn(32, 16)
    ce = measure_loss_memory(head, (x,), {}, F.cross_entropy, torch.randint(0, 512, (32,)))
    assert 2.5 < ce.copies < 3.5  # log_softmax, its gradient, the logits'
    sq = measure_loss_memory(head, (x,), {}, lambda out: out.pow(2).mean(), None)
    assert sq.copies >= 2.5


@pytest.mark.parametrize("chunks", [1, 2])
def test_gpipe_peak_with_a_cross_entropy_over_wide_logits(chunks: int) -> None:
    torch.manual_seed(0)
    vocab = 2048
    model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, vocab))
    x = torch.randint(0, vocab, (16, 32))
    y = torch.randint(0, vocab, (16, 32))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tuning = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe",), chunks=[chunks], checkpoint=("never",),
                         optimizer="sgd", balance_by="params", loss_fn=loss_fn, target=y)
    c = tuning.choices[0]
    pipe = c.pipeline(progress=False)
    try:
        def step() -> None:
            out = pipe(x)  # kept through the backward, as the guide's loop keeps it
            loss_fn(out, y).backward()

        step()
        model.zero_grad(set_to_none=True)
        measured = params + _rise(step)
    finally:
        pipe.close()
    assert c.peak == pytest.approx(measured, rel=0.07), c.peak / measured
