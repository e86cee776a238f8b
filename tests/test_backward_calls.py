"""The backward calls people make on a pipeline's output, beyond ``loss.backward()``.

A checkpointed stage is differentiated by a backward of its own, run inside the outer one,
that accumulates into ``.grad``. What that serves exactly (a second backward with
``retain_graph=True``, several losses from one output) must equal eager; what it cannot
(``torch.autograd.grad``, ``backward(inputs=...)``, ``create_graph=True``) must be refused
with ``CheckpointBackwardError``, never answered with missing gradients. With
``checkpoint='never'`` all of them are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CheckpointBackwardError
from tests.exact import assert_grads_equal

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


# (except_last with one micro-batch checkpoints nothing: exact, like 'never')
@pytest.mark.parametrize("checkpoint, chunks", [("always", 1), ("always", 2), ("except_last", 2)])
def test_autograd_grad_is_refused_not_answered_without_the_recomputed_gradients(checkpoint, chunks):
    model, _, pipe, x = _pair(checkpoint, chunks)
    with pytest.raises(CheckpointBackwardError, match="checkpoint='never'"):
        torch.autograd.grad(pipe(x).sum(), list(model.parameters()))
    with pytest.raises(CheckpointBackwardError, match="inputs="):
        pipe(x).sum().backward(inputs=[model[5].weight])
    assert all(p.grad is None for p in model.parameters()), "a refused backward must not leave gradients"


@pytest.mark.parametrize("checkpoint", CHECKPOINTED)
def test_double_backward_is_refused(checkpoint):
    _, _, pipe, x = _pair(checkpoint)
    x = x.clone().requires_grad_()
    with pytest.raises(CheckpointBackwardError):
        (g,) = torch.autograd.grad(pipe(x).sum(), x, create_graph=True)


def test_without_checkpointing_every_backward_call_is_exact():
    model, ref, pipe, x = _pair("never")
    model.eval(), ref.eval(), pipe.eval()  # no dropout: eager on the whole batch compares
    params, ref_params = list(model.parameters()), list(ref.parameters())
    got = torch.autograd.grad(pipe(x).sum(), params)
    want = torch.autograd.grad(ref(x).sum(), ref_params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    pipe(x).sum().backward(inputs=[model[5].weight])
    ref(x).sum().backward(inputs=[ref[5].weight])
    assert_grads_equal(model, ref)
    xp, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    (gp,) = torch.autograd.grad(pipe(xp).pow(2).sum(), xp, create_graph=True)
    (ge,) = torch.autograd.grad(ref(xe).pow(2).sum(), xe, create_graph=True)
    gp.pow(2).sum().backward()
    ge.pow(2).sum().backward()
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


def test_the_gpipe_front_end_refuses_too():
    model = _model()
    gpipe = fxpipe.GPipe(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=2, checkpoint="always")
    with pytest.raises(CheckpointBackwardError):
        torch.autograd.grad(gpipe(torch.randn(6, 8)).sum(), list(model.parameters()))
    ref = copy.deepcopy(model)
    ref.eval(), gpipe.eval()
    x = torch.randn(6, 8)
    gpipe(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(model, ref)
