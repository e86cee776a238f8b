"""A plan profiled from the build check's run of the first micro-batch (fxpipe.plan._recorded):
the same sizes, copies and cut as a profile that runs the graph itself, and no run of its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.capture._grad_regions import REGION
from fxpipe.capture._tracing import capture
from fxpipe.plan import _make
from fxpipe.plan._profile import profile_graph
from fxpipe.plan._recorded import RecordedRun, profile_recorded

try:
    import zoo
except ImportError:  # pragma: no cover - tests imported as a package
    from tests import zoo


def _same_but_seconds(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert (x.param_count, x.out_bytes, x.param_bytes, x.shape, x.reused_from) == \
            (y.param_count, y.out_bytes, y.param_bytes, y.shape, y.reused_from), name
        assert (x.seconds > 0) == (y.seconds > 0), name


@pytest.mark.parametrize("make", [zoo.gpt_tied, zoo.unet, zoo.resnet_like])
def test_a_recorded_run_profiles_as_a_run_of_its_own(make) -> None:
    model, args, kwargs = make()
    c = capture(model, args, kwargs)
    flat = c.flatten_inputs(args, kwargs)
    record = RecordedRun(c.graph_module, timed=True)
    with torch.no_grad():
        out = record(*flat)
        want = c.graph_module(*flat)
    torch.testing.assert_close(list(out), list(want), rtol=0, atol=0)  # the graph's own result
    assert record.ran_on(flat) and not record.ran_on([x + 1 for x in flat])
    recorded = profile_recorded(record, repeat=2)
    _same_but_seconds(recorded, profile_graph(c.graph_module, flat, repeat=2))
    sizes_only = RecordedRun(c.graph_module, timed=False)
    with torch.no_grad():
        sizes_only(*flat)
    assert all(cost.seconds == 0 for cost in profile_recorded(sizes_only).values())


def test_a_node_runs_in_its_region() -> None:
    """A node traced under torch.no_grad() computes no gradient in the graph's code, nor in a
    recorded run, nor when timed (a backward it never runs is not billed)."""
    class NoGradHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            with torch.no_grad():
                g = self.head(h)
            return h + g

    model, x = NoGradHead(), torch.randn(4, 8)
    c = capture(model, (x,), {})
    assert any(n.meta.get(REGION) for n in c.graph_module.graph.nodes)
    seen = []
    model.head.register_forward_hook(lambda m, i, o: seen.append(torch.is_grad_enabled()))
    record = RecordedRun(c.graph_module, timed=True)
    record(x)  # grad enabled around it: the region switches it off for the head alone
    assert seen == [False]
    profile_recorded(record, repeat=1)
    assert seen[1:] and not any(seen[1:])


def test_the_build_profiles_from_the_checks_run(monkeypatch) -> None:
    """A 'time' and a 'params' build make no profiling run of their own where the check ran the
    plan's micro-batch; where the check ran another (a sample of alike rows, checked on a varied
    copy), the profile runs the graph."""
    def no_run(*a, **k):
        raise AssertionError("the plan ran the graph for a profile the check's run gives")

    monkeypatch.setattr(_make, "profile_graph", no_run)
    monkeypatch.setattr(_make, "count_params_only", no_run)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)), nn.Linear(16, 3))
    x = torch.randn(4, 16)
    for balance_by in ("time", "params"):
        pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by=balance_by, progress=False)
        assert pipe.plan.meta["costs"]["reused"] > 0 if balance_by == "time" else True
        pipe.close()
    with pytest.raises(AssertionError, match="the plan ran the graph"):
        fxpipe.pipeline(model, x[:1].repeat(4, 1), 2, chunks=2, devices=["cpu"] * 2, progress=False)
