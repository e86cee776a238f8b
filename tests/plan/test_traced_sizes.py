"""Sizes for 'params' / 'memory' plans read from an export graph's traced values, not a run."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from torch import nn

from fxpipe.capture._tracing import capture
from fxpipe.plan import _profile
from fxpipe.plan._traced_sizes import traced_sizes


class _Attention(nn.Module):
    """A length-dependent graph: sizes are products and sums of the batch and length symbols."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) + (1 - mask[:, None, :].float()) * -1e4
        h = torch.cat([scores.softmax(-1) @ v, x], dim=1)  # length doubled
        return self.out(h.flatten(0, 1)).view(x.shape[0], -1, 8)[:, ::2]


@lru_cache(maxsize=None)
def _graph():
    x, mask = torch.randn(4, 6, 8), torch.ones(4, 6, dtype=torch.long)
    c = capture(_Attention(), (x, mask), {}, export_only=True)
    assert c.method == "export"
    return c.graph_module


@pytest.mark.parametrize("batch,length", [(4, 6), (2, 6), (3, 11)])
def test_sizes_equal_a_run_without_running(monkeypatch, batch: int, length: int) -> None:
    gm = _graph()
    flat = [torch.randn(batch, length, 8), torch.ones(batch, length, dtype=torch.long)]
    ran = _profile._run(gm, flat, 1, None, timed=False)

    def no_run(*a, **k):
        raise AssertionError("the graph was run for sizes its traced values give")

    monkeypatch.setattr(_profile, "_run", no_run)
    assert _profile.count_params_only(gm, flat) == ran
    assert ran["output"].shape == f"({batch}x{length}x8)"


def test_a_size_the_data_decides_runs_the_graph() -> None:
    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.expert = nn.Linear(8, 1), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            picked = (self.router(x)[:, 0] > 0).nonzero()[:, 0]
            return x.index_add(0, picked, self.expert(x[picked]))

    x = torch.randn(6, 8)
    c = capture(Routed(), (x,), {}, export_only=True)
    gm = c.graph_module
    assert traced_sizes(gm, [x]) is None  # nonzero's size is unbacked
    assert _profile.count_params_only(gm, [x]) == _profile._run(gm, [x], 1, None, timed=False)


def test_an_fx_graph_or_a_fixed_size_that_differs_runs_the_graph() -> None:
    x = torch.randn(4, 6, 8)
    fx_graph = capture(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (x,), {})
    assert fx_graph.method == "fx" and traced_sizes(fx_graph.graph_module, [x]) is None
    gm = _graph()
    assert traced_sizes(gm, [torch.randn(4, 6, 9), torch.ones(4, 6, dtype=torch.long)]) is None  # width fixed
