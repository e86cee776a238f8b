"""Shared checks for the "exact or refused" tests: a pipeline against the eager model.

``assert_exact`` builds the pipeline on a deep copy of the model, runs the same inputs
through both, and compares the outputs and every parameter gradient (a gradient missing on
one side only is a failure too).

How close is close enough lives here, in one place (:class:`Tol`), for every test that
compares a pipeline's floats with eager's. A pipeline computes the same sums as eager in
another order: per micro-batch and then accumulated, with kernels blocked for another batch
size. Float rounding then moves each element by a few units of rounding of the *largest
terms summed*, not of the element itself: an element that is small because large terms
cancel (a position embedding's gradient, a key bias's gradient, which is zero in exact
arithmetic) moves by as much as a large one. A bare absolute tolerance is therefore wrong
both ways: too tight for large gradients (CI failures that depend on the machine), too
loose for small ones. So the allowed difference of each element is

    rtol * |expected element|  +  max(atol, scale * magnitude)

where ``magnitude`` is the largest ``|value|`` of the expected tensor, raised to at least
:data:`FLOOR` times the largest ``|value|`` of all the tensors compared together (all of a
model's gradients, all of an output's leaves), since rounding noise follows the largest
values of the backward rather than the tensor's own. That stays strong: a gradient scaled
by 1.01 or with one element lost, a micro-batch weighted wrongly, all fail
(``tests/test_exact.py`` shows it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

import fxpipe
from fxpipe.tree import flatten

#: a tensor's magnitude counts as at least this fraction of the largest |value| compared with it
FLOOR = 0.1


@dataclass(frozen=True)
class Tol:
    """Elementwise ``|got - expected| <= rtol * |expected| + max(atol, scale * magnitude)``."""

    rtol: float
    #: allowed difference per unit of the tensor's magnitude (its largest |expected| value)
    scale: float
    #: an absolute least allowed difference (0: none; the magnitude floor does that job)
    atol: float = 0.0

    def allowed(self, magnitude: float) -> float:
        """The absolute part of the tolerance for a tensor of this magnitude."""
        return max(self.atol, self.scale * magnitude)


#: float32 sums taken in another order: scale 1e-5 is about 80 float32 epsilons
FP32 = Tol(rtol=1e-4, scale=1e-5)
#: the gradient tolerance tests import: float32
GRAD_TOL = FP32
#: float64 (the skip models): rounding is 2**29 times finer than float32's
FP64 = Tol(rtol=1e-7, scale=1e-9)
#: bfloat16 (autocast among others): micro-batches round differently from the whole batch
#: (8-bit mantissa); the absolute part keeps small values to bfloat16's resolution near 1
BF16 = Tol(rtol=2e-2, scale=2e-2, atol=2e-2)
#: float16: about 5 of its epsilons
FP16 = Tol(rtol=2e-3, scale=5e-3)
#: CUDA: cuBLAS/cuDNN pick other kernels for a micro-batch than for the whole batch
GPU = Tol(rtol=1e-3, scale=5e-5, atol=5e-5)
#: bit for bit: the same computation in the same order
EXACT = Tol(rtol=0.0, scale=0.0, atol=0.0)

#: the tolerance of a comparison that names none: the expected tensor's dtype's
BY_DTYPE = {torch.float64: FP64, torch.float32: FP32, torch.bfloat16: BF16, torch.float16: FP16}

TolLike = Union[Tol, dict, None]


def as_tol(tol: TolLike = None, dtype: torch.dtype = torch.float32, **fields: float) -> Tol:
    """A :class:`Tol` from a Tol, a dict or keywords (``rtol``, ``atol``, ``scale``) over
    the default of ``dtype`` (:data:`BY_DTYPE`). An ``atol`` given without ``scale`` scales
    too (``scale=atol``): it holds for tensors of magnitude up to 1 and grows with larger
    ones, so that no absolute tolerance is ever applied bare to large accumulated values."""
    base = tol if isinstance(tol, Tol) else BY_DTYPE.get(dtype, FP32)
    fields = {**(tol if isinstance(tol, dict) else {}), **fields}
    if "atol" in fields and "scale" not in fields:
        fields["scale"] = fields["atol"]
    return replace(base, **fields) if fields else base


def largest(t: Any) -> float:
    """The largest finite ``|value|`` of a float tensor (0 for anything else)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
        return 0.0
    t = t.detach()
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def assert_close_scaled(got: Any, expected: Any, tol: TolLike = None, *, what: str = "tensor",
                        floor_of: float = 0.0, check_device: bool = True, **fields: float) -> None:
    """``got`` against ``expected`` under the policy of this module. ``floor_of``: the largest
    |value| of the tensors compared together (the tensor's magnitude is at least
    :data:`FLOOR` of it). No ``tol``: the default of ``expected``'s dtype. Integer and bool
    tensors must be equal."""
    if not isinstance(expected, torch.Tensor):  # a float's dtype (its rounding) is unknown
        raise TypeError(f"{what}: assert_close_scaled compares tensors (assert_same: structures of them)")
    if not expected.is_floating_point():
        torch.testing.assert_close(got, expected, rtol=0, atol=0, check_device=check_device,
                                   msg=lambda m: f"{what}: {m}")
        return
    tol = as_tol(tol, expected.dtype, **fields)
    magnitude = max(largest(expected), FLOOR * floor_of)
    atol = tol.allowed(magnitude)
    torch.testing.assert_close(
        got, expected, rtol=tol.rtol, atol=atol, check_device=check_device,
        msg=lambda m: f"{what}: {m}\n(allowed per element: {tol.rtol:g} x |expected| + {atol:.3g}; "
                      f"{atol:.3g} = max({tol.atol:g}, {tol.scale:g} x magnitude {magnitude:.3g}))")


def assert_all_close(named: Iterable[tuple[str, Optional[torch.Tensor], Optional[torch.Tensor]]],
                     tol: TolLike = None, *, check_device: bool = True, **fields: float) -> None:
    """``(name, got, expected)`` triples compared together (a model's gradients, an output's
    leaves): None on both sides matches (a parameter no gradient reaches keeps None, and
    zeros would be another result), None on one side fails."""
    named = list(named)
    top = max((largest(e) for _, _, e in named), default=0.0)
    for name, got, expected in named:
        assert (got is None) == (expected is None), \
            f"{name}: {'None' if got is None else 'a tensor'} vs {'None' if expected is None else 'a tensor'}"
        if expected is not None:
            assert_close_scaled(got, expected, tol, what=name, floor_of=top, check_device=check_device, **fields)


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


def assert_same(a: Any, b: Any, tol: TolLike = None, *, check_device: bool = True, **fields: float) -> None:
    """The same structure, equal non-tensor leaves, tensor leaves close (``a`` against ``b``)."""
    la, sa = flatten(a)
    lb, sb = flatten(b)
    assert sa == sb, f"structures differ:\n{sa}\nvs\n{sb}"
    tensors = []
    for k, (x, y) in enumerate(zip(la, lb)):
        if isinstance(y, torch.Tensor):
            tensors.append((f"output leaf {k}", x, y))
        else:
            assert x == y, f"output leaf {k}: {x!r} vs {y!r}"
    assert_all_close(tensors, tol, check_device=check_device, **fields)


def assert_grads_equal(model: nn.Module, ref: nn.Module, tol: TolLike = None, *, check_device: bool = True,
                       **fields: float) -> None:
    """Every parameter gradient of ``model`` against ``ref``'s, in parameter order."""
    params, refs = list(model.named_parameters()), list(ref.named_parameters())
    assert len(params) == len(refs), f"{len(params)} parameters vs {len(refs)}"
    assert_all_close([(f"grad of {name}", p.grad, q.grad) for (name, p), (_, q) in zip(params, refs)],
                     tol, check_device=check_device, **fields)


def assert_exact(
    model: nn.Module, args: tuple, n_stages: int, *, kwargs: Optional[dict] = None,
    loss: Callable[[Any], torch.Tensor] = weighted_loss, context: Callable[[], Any] = torch.enable_grad,
    tol: TolLike = None, later: Iterable[tuple[tuple, dict]] = (), **options: Any,
) -> fxpipe.Pipeline:
    """Pipeline of a copy of ``model`` vs ``model`` itself: outputs and every gradient, on the
    sample and then on each ``(args, kwargs)`` of ``later`` (other lengths, a smaller batch),
    the gradients of each call alone."""
    kwargs = dict(kwargs or {})
    ref = copy.deepcopy(model)
    piped = copy.deepcopy(model)
    options.setdefault("devices", ["cpu"] * n_stages)
    pipe = fxpipe.pipeline(piped, args, n_stages, sample_kwargs=kwargs or None, **options)
    for call_args, call_kwargs in [(args, kwargs), *later]:
        ref.zero_grad()
        piped.zero_grad()
        with context():
            expected = ref(*call_args, **call_kwargs)
            got = pipe(*call_args, **call_kwargs)
            ref_loss, pipe_loss = loss(expected), loss(got)
        assert_same(got, expected, tol)
        ref_loss.backward()
        pipe_loss.backward()
        assert_grads_equal(piped, ref, tol)
    return pipe


def assert_close_at(eps: float, got, expected, *, grads: bool = False) -> None:
    """Close within 8 ``eps``, relative to each element and to the tensor's largest |value| or,
    for ``grads``, to the largest gradient of the model: a gradient summed over many terms
    that cancel (a bias) keeps the rounding of the terms, not of the sum."""
    pairs = list(zip(tensor_leaves(got), tensor_leaves(expected)))
    top = max((float(b.detach().abs().max()) for _, b in pairs if b.numel()), default=0.0)
    for a, b in pairs:
        scale = top if grads else (float(b.detach().abs().max()) if b.numel() else 0.0)
        torch.testing.assert_close(a.detach().double(), b.detach().double(), rtol=8 * eps, atol=8 * eps * scale)
