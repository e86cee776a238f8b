"""tune's total peak (parameters, gradients, activations) against one measured training step.

Under ``zero_grad='set_to_none'`` (tune's default) no ``.grad`` exists when the step starts:
each stage's gradients come to exist during its first backward and stay, so at the
activations' peak (the backward's start) most of them are not there yet. Under ``'in_place'``
they exist throughout. And ``fxpipe.pipeline``'s one backward over every micro-batch sums
each parameter's gradients before ``.grad``, the first two out of place (three copies at
once). A model of four ``Linear(256)`` has gradients (1 MiB) larger than its activations, so
counting every gradient at the activations' peak over-predicts by about a quarter (1.23), and
missing the sums under-predicts: either fails the 7% asked here (measured: 0.97 to 1.05).

Measured as ``benchmarks/_memory.py`` does: the CPU allocator's records under
``torch.profiler``, their running sum over the step (what the step allocates), plus what
exists before it (the parameters; and ``.grad`` when zeroed in place). Allocations, not time:
the same on every run.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.tuning._loss_memory import cpu_rise


def _rise(fn: Callable[[], None]) -> int:
    """The most bytes ``fn()`` had allocated at once on the CPU, above what existed before."""
    return cpu_rise(fn)


@pytest.mark.parametrize("zero_grad", ["set_to_none", "in_place"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_predicted_total_peak_is_the_measured_one(zero_grad: str, schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())])
    x = torch.randn(64, 256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tuning = fxpipe.tune(model, x, ["cpu"] * 4, schedules=(schedule,), chunks=[1, 2, 4],
                         checkpoint=("never", "always"), optimizer="sgd", balance_by="params", zero_grad=zero_grad)
    assert len(tuning.choices) >= 5
    for c in tuning.choices:
        pipe = c.pipeline(progress=False)
        try:
            def step() -> None:
                if schedule == "gpipe":
                    pipe(x).float().pow(2).mean().backward()
                else:  # 1F1B's backwards run inside step()
                    pipe.step(x, loss_fn=lambda out: out.float().pow(2).mean())

            step()  # warm-up
            model.zero_grad(set_to_none=zero_grad == "set_to_none")
            before = params * (2 if zero_grad == "in_place" else 1)  # parameters (and .grad)
            measured = before + _rise(step)
        finally:
            pipe.close()
            model.zero_grad(set_to_none=True)
        assert c.peak == pytest.approx(measured, rel=0.07), (c.chunks, c.checkpoint, c.peak / measured)
