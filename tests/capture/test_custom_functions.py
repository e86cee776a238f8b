"""Custom ``torch.autograd.Function``s in the model: their backward, not their forward's ops.

Tracing through ``Fn.apply`` records the forward's operations only, and the stage would
differentiate those: a straight-through estimator's upstream gradient was 0 where eager
gives 3.52. Under torch.fx each call is now one node calling ``Fn.apply`` (exact, in the root
forward or a submodule, in every checkpoint mode); under torch.export, which cannot hold the
call, it is refused with AutogradFunctionError unless its module is kept opaque.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.capture._custom_functions import AutogradFunctionError
from tests.exact import assert_exact, assert_grads_equal


class STE(torch.autograd.Function):
    """Straight-through rounding, with a gradient scale that eager and a traced forward disagree on."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g * 3.0


class ScaledMul(torch.autograd.Function):
    """Saves tensors, takes a non-tensor argument and returns two outputs."""

    @staticmethod
    def forward(ctx, x, w, scale: float):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x * w, x.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g, g_sum):
        x, w = ctx.saved_tensors
        return (g * w + g_sum) * ctx.scale, (g * x).sum(0) * 2.0, None


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class NoisySTE(torch.autograd.Function):
    """Draws random numbers in forward: recomputation must draw the same ones."""

    @staticmethod
    def forward(ctx, x):
        return x + torch.rand_like(x).round()

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class RootModel(nn.Module):
    """Functions applied in the root forward, between layers that land on different stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = STE.apply(self.a(x))
        h, s = ScaledMul.apply(self.b(h), self.w, 0.5)
        h = GradReverse.apply(h + s)
        return self.c(h)


class Quantize(nn.Module):
    def forward(self, x):
        return STE.apply(x)


class SubmoduleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.q = Quantize()

    def forward(self, x):
        for layer in self.layers:
            x = self.q(torch.tanh(layer(x)))
        return x


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 3


@pytest.mark.parametrize("n_stages,chunks", [(2, 2), (3, 4), (4, 1)])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_root_functions_exact(n_stages: int, chunks: int, checkpoint: str) -> None:
    torch.manual_seed(0)
    pipe = assert_exact(RootModel(), (_x(),), n_stages, chunks=chunks, checkpoint=checkpoint, progress=False)
    assert pipe.capture.method == "fx"
    code = "\n".join(pipe.stage_code(k) for k in range(pipe.n_stages))
    assert "STE_apply" in code and "ScaledMul_apply" in code and "GradReverse_apply" in code


def test_issue_case_upstream_gradient() -> None:
    """The gradient upstream of STE.apply is eager's (3x the identity's), not 0."""
    torch.manual_seed(0)
    model = RootModel()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, _x(), 2, chunks=2, devices=["cpu"] * 2, split_points=["b"], progress=False)
    pipe(_x()).sum().backward()
    ref(_x()).sum().backward()
    assert ref.a.weight.grad.abs().sum() > 0
    assert_grads_equal(model, ref)


def test_functions_in_a_submodule_are_traced_around() -> None:
    """The Function no longer makes its module opaque: the layers around it can be cut."""
    torch.manual_seed(0)
    pipe = assert_exact(SubmoduleModel(), (_x(),), 4, chunks=2, progress=False)
    assert pipe.capture.leaves == []


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_random_function_recomputed_identically(checkpoint: str) -> None:
    """A Function that draws is user code to the RNG policy: recomputation draws the same."""
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(NoisySTE.apply(self.a(x)))

    torch.manual_seed(0)
    model = Noisy()
    pipe = fxpipe.pipeline(model, _x(), 2, chunks=2, devices=["cpu"] * 2, checkpoint=checkpoint, progress=False)
    torch.manual_seed(5)
    pipe(_x()).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    other = fxpipe.pipeline(model, _x(), 2, chunks=2, devices=["cpu"] * 2, checkpoint="never", plan=pipe.plan,
                            progress=False)
    torch.manual_seed(5)
    other(_x()).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_several_optimizer_steps() -> None:
    torch.manual_seed(0)
    model = RootModel()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, _x(), 3, chunks=2, devices=["cpu"] * 3, progress=False)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x = _x() + step
        for m, o, run in ((model, opt, pipe), (ref, ref_opt, ref)):
            o.zero_grad()
            run(x).pow(2).mean().backward()
            o.step()
        assert_grads_equal(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


class ExportRoot(nn.Module):
    """A root torch.fx cannot trace (``len`` of a tensor), so the capture is torch.export's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.q, self.b = nn.Linear(8, 8), Quantize(), nn.Linear(8, 8)

    def forward(self, x):
        if len(x) > 0:
            x = self.a(x)
        return self.b(self.q(x))


def test_export_capture_refused() -> None:
    with pytest.raises(AutogradFunctionError) as info:
        fxpipe.pipeline(ExportRoot(), _x(), 2, devices=["cpu"] * 2, progress=False)
    message = str(info.value)
    assert "STE" in message and "leaf_modules" in message
    assert "return STE.apply(x)" in info.value.location
    assert isinstance(info.value, fxpipe.TraceError)


def test_export_capture_with_the_module_opaque_is_exact() -> None:
    torch.manual_seed(0)
    pipe = assert_exact(ExportRoot(), (_x(),), 2, chunks=2, leaf_modules=["q"], progress=False)
    assert pipe.capture.method == "export"


def test_apply_restored_after_capture() -> None:
    before = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(AutogradFunctionError):
        fxpipe.pipeline(ExportRoot(), _x(), 2, devices=["cpu"] * 2, progress=False)
    fxpipe.pipeline(RootModel(), _x(), 2, devices=["cpu"] * 2, progress=False)
    assert torch.autograd.Function.__dict__["apply"] is before
