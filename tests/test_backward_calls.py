"""The backward calls people make on a pipeline's output, beyond ``loss.backward()``.

A checkpointed stage keeps its forward graph and recomputes only the tensors that graph
saved (saved-tensor hooks), so every backward call -- a second one with
``retain_graph=True``, several losses from one output, ``torch.autograd.grad``,
``backward(inputs=...)``, ``create_graph=True`` -- differentiates the same graph as eager
and must equal eager in every checkpoint mode, also with portals between stages.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.runtime._pipeline import PipelineRunner
from tests.exact import assert_all_close, assert_close_scaled, assert_grads_equal
from tests.zoo import ZOO

CHECKPOINTED = ["always", "except_last"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _pair(checkpoint: str, chunks: int = 2):
    model = _model()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, 3, chunks=chunks, checkpoint=checkpoint, devices=["cpu"] * 3,
                           balance_by="params")
    return model, ref, pipe, x


def _assert_grads(model: nn.Module, got, want) -> None:
    """Gradients returned by ``torch.autograd.grad``, in ``model.parameters()`` order."""
    names = [name for name, _ in model.named_parameters()]
    assert len(got) == len(want) == len(names)
    assert_all_close([(f"grad of {n}", a, b) for n, a, b in zip(names, got, want)])


def _eager_like(pipe, ref, model, x, run):
    """``run(forward)`` for the pipeline and for eager with the same dropout masks: eager
    runs the micro-batches in turn from the same RNG state (what the pipeline computes)."""
    state = torch.get_rng_state()
    run(pipe)
    torch.set_rng_state(state)
    run(lambda inp: torch.cat([ref(c) for c in inp.chunk(pipe.chunks)]))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_retain_graph_then_a_second_backward(checkpoint):
    model, ref, pipe, x = _pair(checkpoint)

    def run(forward):
        loss = forward(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    _eager_like(pipe, ref, model, x, run)
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_two_losses_from_one_output(checkpoint):
    model, ref, pipe, x = _pair(checkpoint)

    def run(forward):
        out = forward(x)
        out[:, 0].sum().backward(retain_graph=True)
        out[:, 1].pow(2).sum().backward()

    _eager_like(pipe, ref, model, x, run)
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("checkpoint, chunks", [("always", 1), ("always", 2), ("except_last", 2), ("never", 2)])
def test_autograd_grad_and_backward_inputs_are_exact(checkpoint, chunks):
    model, ref, pipe, x = _pair(checkpoint, chunks)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    got, want = {}, {}

    def run(forward):
        out = got if forward is pipe else want
        out["grad"] = torch.autograd.grad(forward(x).pow(2).sum(), params if forward is pipe else ref_params)

    _eager_like(pipe, ref, model, x, run)
    _assert_grads(model, got["grad"], want["grad"])
    assert all(p.grad is None for p in params), "torch.autograd.grad must not accumulate into .grad"

    def run_inputs(forward):
        w = model[5].weight if forward is pipe else ref[5].weight
        forward(x).pow(2).sum().backward(inputs=[w])

    _eager_like(pipe, ref, model, x, run_inputs)
    assert_grads_equal(model, ref)
    assert model[0].weight.grad is None  # not among inputs=: left alone, as in eager


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_double_backward_is_exact(checkpoint):
    model, ref, pipe, x = _pair(checkpoint)
    grads = {}

    def run(forward):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(forward(xi).pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
        grads[forward is pipe] = g.detach()

    _eager_like(pipe, ref, model, x, run)
    assert_close_scaled(grads[True], grads[False], what="input gradient")
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("ahead", [None, True], ids=["lazy", "ahead"])  # recompute_ahead: as on CPU, as on GPUs
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_backward_call_through_portals_is_exact(monkeypatch, checkpoint, ahead):
    """The U-Net's long skips become portals; a checkpointed pop stage recomputes from the
    portal's value once per backward, also a second time through a retained graph."""
    monkeypatch.setattr(PipelineRunner, "recompute_ahead", ahead)
    model, args, _ = ZOO["unet"]()
    ref = copy.deepcopy(model)
    (x,) = args
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, checkpoint=checkpoint, devices=["cpu"] * 3, balance_by="params")
    assert pipe.plan.portals

    def eager(inp):
        return torch.cat([ref(c) for c in inp.chunk(2)])

    for forward, module in ((pipe, model), (eager, ref)):
        loss = forward(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_equal(model, ref)
    got = torch.autograd.grad(pipe(x).pow(2).sum(), list(model.parameters()))
    want = torch.autograd.grad(eager(x).pow(2).sum(), list(ref.parameters()))
    _assert_grads(model, got, want)
    gs = []
    for forward in (pipe, eager):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(forward(xi).pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
        gs.append(g.detach())
    assert_close_scaled(gs[0], gs[1], what="input gradient")
    assert_grads_equal(model, ref)


class _ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))), self.a.weight


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_a_parameter_returned_as_an_output(checkpoint, chunks):
    torch.manual_seed(0)
    model = _ReturnsItsWeight()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 4)
    pipe = fxpipe.pipeline(model, x, 2, chunks=chunks, checkpoint=checkpoint, devices=["cpu"] * 2,
                           balance_by="params", output_merge={"1": "first"})
    out, w = pipe(x)
    (out.pow(2).sum() + w.sum()).backward()
    out_e, w_e = ref(x)
    (out_e.pow(2).sum() + w_e.sum()).backward()
    torch.testing.assert_close(out, out_e)
    assert_grads_equal(model, ref)
    assert model.a.weight.is_leaf and model.a.weight.grad_fn is None  # still the model's Parameter


def test_the_gpipe_front_end_serves_autograd_grad():
    model = _model()
    ref = copy.deepcopy(model)
    gpipe = fxpipe.GPipe(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=2, checkpoint="always")
    x = torch.randn(6, 8)
    state = torch.get_rng_state()
    got = torch.autograd.grad(gpipe(x).pow(2).sum(), list(model.parameters()))
    torch.set_rng_state(state)
    want = torch.autograd.grad(torch.cat([ref(c) for c in x.chunk(2)]).pow(2).sum(), list(ref.parameters()))
    _assert_grads(model, got, want)
