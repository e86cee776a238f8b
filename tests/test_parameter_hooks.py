"""A parameter's gradient hook sees each backward's part of its gradient. Eager (and GPipe's
one backward over every micro-batch) calls it once, on the sum; 1F1B runs one backward per
micro-batch, so ``p.register_hook(lambda g: g.clamp(-c, c))`` clamped each part (a trial:
gradients 2.6x off) and an optimizer stepped in ``register_post_accumulate_grad_hook``
stepped once per micro-batch. Exact under GPipe, refused under 1F1B (and on ranks, where
every schedule runs a backward per micro-batch: tests/distributed/test_parameter_hooks_ranks.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import StepError

from exact import assert_grads_equal


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _clamped(model: nn.Module) -> None:
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.02, 0.02))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_gradient_hook_is_exact_under_gpipe(checkpoint: str) -> None:
    model, x, y = _model(), torch.randn(16, 16), torch.randn(16, 4)
    ref = copy.deepcopy(model)
    with fxpipe.pipeline(model, x, 2, chunks=4, devices=["cpu"] * 2, checkpoint=checkpoint, progress=False) as pipe:
        _clamped(model)
        _clamped(ref)
        pipe.step(x, loss_fn=_loss, target=y)
    _loss(ref(x), y).backward()
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_is_refused_under_1f1b(hook: str) -> None:
    model, x, y = _model(), torch.randn(16, 16), torch.randn(16, 4)
    with fxpipe.pipeline(model, x, 2, chunks=4, devices=["cpu"] * 2, schedule="1f1b", progress=False) as pipe:
        getattr(model[2].weight, hook)(lambda *a: None)
        with pytest.raises(StepError, match=r"parameter '2\.weight' has a gradient hook.*schedule='gpipe'"):
            pipe.step(x, loss_fn=_loss, target=y)
        assert all(p.grad is None for p in model.parameters())  # refused before anything ran
