"""Shared check for the "exact or refused" tests: a pipeline against the eager model.

``assert_exact`` builds the pipeline on a deep copy of the model, runs the same inputs
through both, and compares the outputs and every parameter gradient (a gradient missing on
one side only is a failure too).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

import fxpipe
from fxpipe.tree import flatten

GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]


def weighted_loss(out: Any) -> torch.Tensor:
    """A loss that gives every float output element its own weight (so no gradient hides)."""
    leaves = tensor_leaves(out)
    total = torch.zeros((), device=leaves[0].device if leaves else "cpu")
    for i, t in enumerate(leaves):
        if t.is_floating_point() and t.requires_grad:
            w = torch.linspace(-1, 1, t.numel(), dtype=torch.float32, device=t.device).view(t.shape) * (i + 1)
            total = total + (t.float() * w).sum().to(total.device)
    return total


def assert_same(a: Any, b: Any, **tol: Any) -> None:
    la, sa = flatten(a)
    lb, sb = flatten(b)
    assert sa == sb, f"structures differ:\n{sa}\nvs\n{sb}"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, **(tol or GRAD_TOL))
        else:
            assert x == y


def assert_grads_equal(model: nn.Module, ref: nn.Module, **tol: Any) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"grad of {name}: {p.grad is None=} {q.grad is None=}"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"grad of {name}: {m}", **(tol or GRAD_TOL))


def assert_exact(
    model: nn.Module, args: tuple, n_stages: int, *, kwargs: Optional[dict] = None,
    loss: Callable[[Any], torch.Tensor] = weighted_loss, context: Callable[[], Any] = torch.enable_grad,
    tol: Optional[dict] = None, **options: Any,
) -> fxpipe.Pipeline:
    """Pipeline of a copy of ``model`` vs ``model`` itself: outputs and every gradient."""
    kwargs = dict(kwargs or {})
    ref = copy.deepcopy(model)
    piped = copy.deepcopy(model)
    options.setdefault("devices", ["cpu"] * n_stages)
    pipe = fxpipe.pipeline(piped, args, n_stages, sample_kwargs=kwargs or None, **options)
    with context():
        expected = ref(*args, **kwargs)
        got = pipe(*args, **kwargs)
        ref_loss, pipe_loss = loss(expected), loss(got)
    assert_same(got, expected, **(tol or {}))
    ref_loss.backward()
    pipe_loss.backward()
    assert_grads_equal(piped, ref, **(tol or {}))
    return pipe
