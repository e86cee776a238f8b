"""tune's timing: the loss after the model is in the predicted step, and the notes state how
far the stage timing moved between its interleaved rounds. Nothing here asserts a time the
machine measured: the loss's seconds are stood in for, and the spread is only read."""

from __future__ import annotations

import re
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
import fxpipe.tuning._search_timing as search_timing


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def test_the_loss_is_timed_on_one_micro_batch_and_counted_in_every_micro_batchs_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = _model(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    seen: List[tuple] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(out.shape), tuple(target.shape), out.requires_grad))
        return F.cross_entropy(out, target)

    options: dict = dict(schedules=("gpipe",), chunks=[1, 2], checkpoint=("never",), optimizer="sgd")
    fxpipe.tune(model, x, ["cpu"], loss_fn=loss_fn, target=y, **options)
    assert {(4, 4), (8, 8)} <= {(o[0], t[0]) for o, t, _ in seen}  # each micro-batch size, output and target
    assert all(grad for _, _, grad in seen)

    def stand_in(*args: Any, **kwargs: Any) -> tuple:
        return 1.0, 2.0  # forward, backward seconds: far above the model's own

    monkeypatch.setattr(search_timing, "time_loss", stand_in)
    with_loss = {c.chunks: c for c in fxpipe.tune(model, x, ["cpu"], loss_fn=loss_fn, target=y, **options).choices}
    for chunks, c in with_loss.items():  # one device: every micro-batch's loss, forward and backward, in turn
        assert 3.0 * chunks <= c.step_s < 3.0 * chunks + 1.0
    assert any("loss_fn timed" in n for n in fxpipe.tune(model, x, ["cpu"], loss_fn=loss_fn, target=y,
                                                         **options).notes)


def test_the_notes_state_the_spread_of_the_stage_timing() -> None:
    model, x = _model(), torch.randn(8, 16)
    t = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe",), chunks=[1, 2], checkpoint=("never",))
    found = [re.search(r"moved by (\d+)%-(\d+)%", n) for n in t.notes]
    spreads = [m for m in found if m]
    assert len(spreads) == 1
    low, high = map(int, spreads[0].groups())
    assert 0 <= low <= high
    assert not any("loss_fn" in n for n in t.notes)  # no loss given, none timed
