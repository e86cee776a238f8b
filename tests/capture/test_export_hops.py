"""Higher-order ops and leaf_modules on the torch.export path (issue #10, parts 1 and 2).

Each model's root forward checks ``x.dim()`` as a Python bool, which torch.fx cannot trace,
so every pipeline here is captured by torch.export. Compared with eager: outputs and every
parameter gradient, None vs tensor included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.plan._profile import profile_graph
from fxpipe.errors import TraceError

from exact import assert_exact


class GradOffRegion(nn.Module):
    """A gate computed under ``torch.no_grad()``: eager gives ``gate`` no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.mid, self.out = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            g = torch.sigmoid(self.gate(h))
        return self.out(torch.tanh(self.mid(h)) * g)


class AutocastOffRegion(nn.Module):
    """A float32 island under the caller's autocast, like the rotary tables of transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.precise, self.out = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        h = self.inp(x)
        with torch.autocast("cpu", enabled=False):
            p = self.precise(h.float())
        return self.out(h) + p


def test_no_grad_region_keeps_its_semantics():
    pipe = assert_exact(GradOffRegion(), (torch.randn(6, 8),), 3, chunks=2, balance_by="params")
    assert pipe.capture.method == "export"
    assert all(p.grad is None for p in pipe.module.gate.parameters())  # as eager: checked by assert_exact
    holders = [k for k, s in enumerate(pipe.stages) if "wrap_with_set_grad_enabled(False" in s.code]
    assert len(holders) == 1
    stage = pipe.stages[holders[0]]
    bodies = [n.target for n in stage.graph.nodes if n.op == "get_attr"
              and isinstance(getattr(stage, n.target, None), torch.fx.GraphModule)]
    assert bodies and all(isinstance(getattr(stage, b), torch.fx.GraphModule) for b in bodies)


def test_no_grad_region_profiled_by_time():
    """balance_by='time' (the default) runs the region's call in the profiler: exact, and costed."""
    pipe = assert_exact(GradOffRegion(), (torch.randn(6, 8),), 3, chunks=2)
    gm = pipe.capture.graph_module
    calls = [n.name for n in gm.graph.nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled]
    assert len(calls) == 1
    costs = profile_graph(gm, pipe.capture.flatten_inputs((torch.randn(3, 8),)))
    assert costs[calls[0]].seconds > 0 and costs[calls[0]].out_bytes == 3 * 8 * 4


def test_no_grad_region_gradients_are_none_like_eager():
    model = GradOffRegion()
    pipe = fxpipe.pipeline(model, torch.randn(6, 8), 3, chunks=2, devices=["cpu"] * 3, balance_by="params")
    pipe(torch.randn(6, 8)).sum().backward()
    assert model.gate.weight.grad is None and model.gate.bias.grad is None
    assert model.inp.weight.grad is not None


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_autocast_off_region_stays_float32_under_autocast(checkpoint):
    model = AutocastOffRegion()
    x = torch.randn(6, 8)

    def context():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    pipe = assert_exact(model, (x,), 2, chunks=2, balance_by="params", context=context, checkpoint=checkpoint,
                        tol=dict(rtol=2e-2, atol=2e-2))
    assert any("wrap_with_autocast" in s.code for s in pipe.stages)
    with context():
        assert pipe(x).dtype == copy.deepcopy(model)(x).dtype == torch.float32


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(self.a.bias.sum() > 0, lambda x: self.a(x), lambda x: -self.a(x), (x,))


class WithBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.branchy, self.post = nn.Linear(8, 8), Branchy(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        return self.post(self.branchy(torch.relu(self.pre(x))))


def test_unknown_higher_order_op_is_refused_naming_it_and_leaf_modules_fixes_it():
    with pytest.raises(TraceError) as info:
        fxpipe.pipeline(WithBranchy(), torch.randn(6, 8), 2, chunks=2, balance_by="params")
    msg = str(info.value)
    assert "torch.ops.higher_order.cond" in msg and "'branchy'" in msg
    assert "test_export_hops.py" in msg and "torch.cond(" in msg  # the source line
    assert "leaf_modules=['branchy']" in msg
    assert info.value.module == "branchy"
    pipe = assert_exact(WithBranchy(), (torch.randn(6, 8),), 2, chunks=2, balance_by="params",
                        leaf_modules=["branchy"])
    assert pipe.capture.method == "export" and pipe.capture.leaves == ["branchy"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 2.0, mask: torch.Tensor | None = None) -> dict:
        return {"y": self.b(torch.tanh(self.a(x))) * scale + mask, "z": x.sum(-1)}


class SharedBlock(nn.Module):
    """One block called twice, with a constant, a keyword tensor and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.pre, self.mid = Block(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        r = self.block(self.pre(x), 3.0, mask=x)
        r2 = self.block(self.mid(r["y"]), 0.5, mask=x)
        return r2["y"] + r["z"][:, None]


@pytest.mark.parametrize("leaf", [Block, "block"])
def test_leaf_module_called_twice_is_one_node_per_call(leaf):
    pipe = assert_exact(SharedBlock(), (torch.randn(6, 8),), 3, chunks=2, balance_by="params",
                        leaf_modules=[leaf])
    calls = [n for s in pipe.stages for n in s.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["block", "block"]
    assert [n.args[1] for n in calls] == [3.0, 0.5]
    assert not any(str(n.meta.get("fxpipe_module", "")).startswith("block.")
                   for s in pipe.stages for n in s.graph.nodes)


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class WithNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.body, self.post = nn.Linear(8, 8), NormBlock(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        return self.post(torch.relu(self.body(self.pre(x))))


def test_leaf_updating_buffers_updates_them_once_per_micro_batch():
    """The opaque block runs eagerly and updates its BatchNorm statistics itself (the
    export graph's copy_ into the buffers is dropped with the block's nodes)."""
    model = WithNormBlock().train()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", leaf_modules=["body"])
    assert pipe.capture.method == "export" and pipe.capture.leaves == ["body"]
    out = pipe(x)
    expected = torch.cat([ref(x[:3]), ref(x[3:])])  # the model run on the micro-batches in turn
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model.body.norm.running_mean, ref.body.norm.running_mean)
    assert int(model.body.norm.num_batches_tracked) == int(ref.body.norm.num_batches_tracked) == 2
