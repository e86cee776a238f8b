"""Grad-mode and autocast regions inside a traced forward are exact (fxpipe.capture._grad_regions).

torch.fx does not record ``with torch.no_grad():`` and friends: without fxpipe's region
recording a pipeline gives ``a.weight`` a gradient eager leaves ``None``, or computes a
float32 region in bfloat16 under an outer autocast. Every construct is run in every
checkpoint mode, on 1, 2 and 3 stages with a cut *inside* the region, with and without an
outer ``torch.autocast('cpu', dtype=torch.bfloat16)``, against eager (outputs -- dtype
included -- and every gradient, ``None`` where eager has ``None``).
"""

import copy

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_exact, assert_grads_equal, assert_same, weighted_loss
from fxpipe.capture._grad_regions import REGION

MODES = ["always", "except_last", "never"]
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)


class NoGrad(_Three):
    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
            h = torch.tanh(h).mul(2)
            h = self.b(h)
        return h, self.c(x) + h


class EnableGradInsideNoGrad(_Three):
    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
            with torch.enable_grad():
                h = self.b(h).relu()
        return self.c(x) * h


class SetGradEnabled(_Three):
    def forward(self, x):
        with torch.set_grad_enabled(False):
            h = self.a(x).sigmoid()
            with torch.set_grad_enabled(True):
                h = self.b(h)
        return self.c(h)


class InferenceMode(_Three):
    """Inference tensors cannot cross stages: the region and its first uses share a stage."""

    def forward(self, x):
        with torch.inference_mode():
            h = self.a(x)
            h = self.b(h).tanh()
        h = h.clone()
        return self.c(h) + x


class AutocastOff(_Three):
    """The rotary-embedding pattern: a float32 region inside the forward."""

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            r = h.float().cos()
            r = self.b(r)
        return r, self.c(r)


class AutocastOn(_Three):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
            h = self.b(h)
        return h, self.c(h.float())


class DecoratedNoGrad(_Three):
    @torch.no_grad()
    def _frozen(self, x):
        return self.b(self.a(x))

    def forward(self, x):
        h = self._frozen(x)
        return self.c(x) - h


class DecoratedAutocastOff(_Three):
    @torch.autocast("cpu", enabled=False)
    def _fp32(self, x):
        return self.b(self.a(x.float()))

    def forward(self, x):
        h = self._fp32(x)
        return h, self.c(h)


class InPlaceInNoGrad(_Three):
    """An in-place op in a no_grad region (fxpipe runs it on a copy): gradient passes it by."""

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h.mul_(2)
        return self.c(self.b(h))


CONSTRUCTS = [NoGrad, EnableGradInsideNoGrad, SetGradEnabled, InferenceMode, AutocastOff, AutocastOn,
              DecoratedNoGrad, DecoratedAutocastOff, InPlaceInNoGrad]
# a cut before `b` falls inside the region; where the region's nodes must share a stage
# (inference tensors; an in-place op and its copy) the cut falls after it
CUTS = {1: None, 2: ["b"], 3: ["b", "c"]}
WHOLE = {InferenceMode: ["a", "b"], InPlaceInNoGrad: ["a", "a_copy", "mul_"]}
CASES = [(cls, n) for cls in CONSTRUCTS for n in ((1, 2) if cls in WHOLE else sorted(CUTS))]


def _outer_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("outer", ["none", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls,n_stages", CASES, ids=[f"{c.__name__}-{n}" for c, n in CASES])
def test_region_is_exact(cls, mode, n_stages, outer):
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(6, 8)
    context = _outer_bf16 if outer == "bf16" else torch.enable_grad
    tol = BF16_TOL if outer == "bf16" or cls is AutocastOn else None
    cuts = ["c"] if cls in WHOLE and n_stages == 2 else CUTS[n_stages]
    pipe = assert_exact(model, (x,), n_stages, chunks=2, checkpoint=mode, split_points=cuts,
                        balance_by="params", context=context, tol=tol)
    stages_in_regions = {pipe.plan.assignment[n.name] for n in pipe.capture.graph_module.graph.nodes
                         if REGION in n.meta}
    if cls in WHOLE:
        assert {pipe.plan.assignment[name] for name in WHOLE[cls]} == {0}
    else:
        assert len(stages_in_regions) == min(n_stages, 2)  # the region straddles the cut before `b`


def test_inference_mode_cut_is_refused():
    with pytest.raises(ValueError, match=r"'b' is inside a group .*inference_mode\(\)"):
        fxpipe.pipeline(InferenceMode(), torch.randn(4, 8), 2, split_points=["b"], devices=["cpu"] * 2,
                        balance_by="params")


def test_regions_are_recorded_and_emitted():
    torch.manual_seed(0)
    pipe = fxpipe.pipeline(NoGrad(), torch.randn(4, 8), 2, split_points=["b"], devices=["cpu"] * 2,
                           balance_by="params")
    regions = {n.name: n.meta.get(REGION) for n in pipe.capture.graph_module.graph.nodes}
    assert regions["a"] == regions["b"] == (("grad", False),)
    assert regions["c"] is None
    assert "fxpipe_no_grad__call(self.a, x)" in pipe.stage_code(0)
    assert "fxpipe_no_grad__call(self.b, " in pipe.stage_code(1)
    assert "self.c(" in pipe.stage_code(1)
    # the graphs keep their call_module nodes (placement and planning read them)
    assert pipe.stages[0].graph.find_nodes(op="call_module", target="a")


def test_autocast_off_region_stays_float32_under_outer_autocast():
    torch.manual_seed(0)
    model = AutocastOff()
    pipe = fxpipe.pipeline(copy.deepcopy(model), torch.randn(4, 8), 2, split_points=["b"],
                           devices=["cpu"] * 2, balance_by="params")
    with _outer_bf16():
        got, expected = pipe(torch.randn(4, 8)), model(torch.randn(4, 8))
    assert got[0].dtype == expected[0].dtype == torch.float32
    assert got[1].dtype == expected[1].dtype == torch.bfloat16


@pytest.mark.parametrize("mode", MODES)
def test_enable_grad_region_under_a_no_grad_call(mode):
    """Called under no_grad, an enable_grad region still records (its output needs grad)."""
    torch.manual_seed(0)
    model = EnableGradInsideNoGrad()
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(copy.deepcopy(model), x, 2, chunks=2, checkpoint=mode, split_points=["b"],
                           devices=["cpu"] * 2, balance_by="params")
    with torch.no_grad():
        got, expected = pipe(x), model(x)
    assert got.requires_grad == expected.requires_grad
    assert_same(got, expected)


@pytest.mark.parametrize("threads", [False, True])
def test_worker_threads_enter_the_region(threads):
    torch.manual_seed(0)
    model = NoGrad()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, 3, chunks=3, split_points=["b", "c"], devices=["cpu"] * 3,
                           balance_by="params")
    pipe._runtime.threads = threads
    with _outer_bf16():
        got, expected = pipe(x), ref(x)
        got_loss, ref_loss = weighted_loss(got), weighted_loss(expected)
    assert_same(got, expected, **BF16_TOL)
    got_loss.backward()
    ref_loss.backward()
    assert_grads_equal(model, ref, **BF16_TOL)
    assert model.a.weight.grad is None and model.b.weight.grad is None


class _StatementNoGrad(nn.Module):
    """``torch.set_grad_enabled(False)`` as a statement: not a region fxpipe can follow."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        torch.set_grad_enabled(False)
        h = self.lin(x)
        torch.set_grad_enabled(True)
        return h


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = _StatementNoGrad()
        self.post = nn.Linear(8, 8)

    def forward(self, x):
        return self.post(self.inner(self.pre(x)) + x)


def test_mode_set_by_a_statement_keeps_the_module_opaque():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="inner.*grad mode"):
        pipe = assert_exact(_Outer(), (torch.randn(4, 8),), 2, chunks=2, balance_by="params")
    assert "inner" in pipe.capture.leaves
    assert torch.is_grad_enabled()


def test_mode_left_changed_by_the_forward_is_refused():
    class Leaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            torch.set_grad_enabled(False)
            return h

    from fxpipe.capture._grad_regions import RegionError, RegionRecorder
    with pytest.raises(RegionError, match="leaves grad mode changed"):
        with RegionRecorder():
            Leaks()(torch.randn(2, 8))
    assert torch.is_grad_enabled()
