"""A forward that draws random numbers with no tensor argument (``torch.rand([]) < p`` of a
LayerDrop or stochastic depth, ``torch.randint(0, 3, ())`` of a time mask) runs that call
while torch.fx traces it. The draw, or the branch it decided, was baked into the graph as a
constant: every call repeated the build's one draw, where eager draws anew (a trial: 1
distinct output over 30 calls against eager's 2-8). Such a module is now kept opaque (it runs
eagerly, drawing per call); a root forward is captured by torch.export, which records the
call as an op; a Python branch on the draw is refused, naming its line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import TraceError


class Gate(nn.Module):
    """Batch-level stochastic depth written with torch ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand([]) < 0.5).float()
        return self.a(x) * keep + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(8, 8), Gate(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(torch.tanh(self.inp(x))))


class RootGate(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h * (torch.rand([]) < 0.5).float() + h)


class LayerDrop(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.training and torch.rand([]) < 0.5:  # a Python branch on a draw: no graph can hold it
            return self.out(h)
        return self.out(self.gate.a(h))


def _distinct(fn, x: torch.Tensor, calls: int = 20) -> int:
    with torch.no_grad():
        return len({round(fn(x).sum().item(), 5) for _ in range(calls)})


@pytest.mark.parametrize("cls, method", [(Net, "fx"), (RootGate, "export")])
def test_a_draw_without_a_tensor_argument_is_drawn_per_call(cls, method) -> None:
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 8)
    rng = torch.get_rng_state()
    with fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False) as pipe:
        assert torch.equal(torch.get_rng_state(), rng)  # the build leaves torch's RNG as it was
        assert pipe.capture.method == method
        if method == "fx":
            assert "gate" in pipe.capture.leaves  # kept whole: it runs eagerly, drawing per call
        assert _distinct(pipe, x) > 1  # baked, it gave one output over every call


def test_a_python_branch_on_a_draw_is_refused_naming_its_line() -> None:
    with pytest.raises(TraceError, match=r"torch.rand\(\[\]\) < 0.5"):
        fxpipe.pipeline(LayerDrop(), torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)


class PythonDrop(nn.Module):
    """timm-style stochastic depth written with Python's random (or numpy's)."""

    def __init__(self, numpy: bool) -> None:
        super().__init__()
        self.f, self.numpy = nn.Linear(8, 8), numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            import random

            import numpy as np

            if (float(np.random.rand()) if self.numpy else random.random()) < 0.5:
                return x
        return x + self.f(x)


class PythonDropNet(Net):
    def __init__(self, numpy: bool) -> None:
        super().__init__()
        self.gate = PythonDrop(numpy)


@pytest.mark.parametrize("numpy", [False, True], ids=["random", "numpy"])
@pytest.mark.parametrize("seed", range(4))
def test_a_draw_from_python_or_numpy_is_refused_naming_the_module(numpy, seed):
    """Baked into the graph at the build's one draw (the build's check caught it only when its
    eager run happened to draw otherwise: 1 distinct output over 20 calls, a trial)."""
    import random

    import numpy as np

    from fxpipe.capture._trace_time import DrewFromPython

    random.seed(seed)
    np.random.seed(seed)
    before = (random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(DrewFromPython, match="module 'gate' draws from Python's random or numpy's"):
        fxpipe.pipeline(PythonDropNet(numpy), torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()  # put back
