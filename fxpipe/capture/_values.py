"""Whether two values the build computed agree: exactly, or within the precision in effect.

Tensors: the one comparison behind the build's checks: the seeded rerun of the model
(:mod:`fxpipe.capture._prepare`), the whole batch against its micro-batches merged
(:mod:`fxpipe.checks._batching`), eval against training mode (:mod:`fxpipe.checks._modes`).
A tolerance that did not follow the precision would refuse a bf16 model for its rounding,
or pass a float32 model that mixes samples; :func:`fxpipe.capture._numerics.tolerance` decides it.

Plain Python values (:func:`same_plain`): a non-tensor argument the graph was specialised on
against a call's (:mod:`._call_inputs`), an attribute the trace read against its value now
(:mod:`._attr_reads`, :mod:`._model_check`). Same type and equal: ``1`` is not ``1.0``
(another literal in the graph), ``True`` not ``1``; NaN is NaN.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ._numerics import tolerance

__all__ = ["same_value", "exactly_same", "same_plain", "concatenated_dim", "kept_for_comparison"]


def same_value(a: Any, b: Any, *, values: bool = True) -> bool:
    """Whether two outputs agree: same type, shape and dtype, and (with ``values``) close."""
    return _same(a, b, exact=False, values=values)


def exactly_same(a: Any, b: Any) -> bool:
    """Same type, shape, dtype and bits (a rerun that drew the same random numbers)."""
    return _same(a, b, exact=True)


def _same(a: Any, b: Any, *, exact: bool, values: bool = True) -> bool:
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return False
    if not isinstance(a, Tensor):
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - values without a boolean ==
            return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not values:
        return True
    if a.is_meta or b.is_meta:  # no values to compare (a meta-device model): unknown, so not 'exact'
        return not exact
    if exact:
        return bool(torch.equal(a, b))
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    a, b = a.detach(), b.detach()  # a comparison: no graph
    if torch.equal(a, b):  # bit for bit (a split that changes no reduction): one cheap pass
        return True
    rtol, atol = tolerance(a.dtype)  # follows the precision in effect (fxpipe.capture._numerics)
    if a.dtype in _IN_FLOAT32 and a.numel():
        # within the absolute part of the tolerance, the commonest case, decided in float32 (its
        # rounding, 1e-7, is far below the tolerances): a double copy of GPT-2's logits cost a
        # second a comparison, several per build. Else (and where anything is not finite) torch's
        # allclose in double decides, as before.
        a32, b32 = a.float(), b.float()
        scale = float(a32.abs().max())
        if math.isfinite(scale) and float((a32 - b32).abs_().max()) <= atol * max(scale, 1.0):
            return True
    a64, b64 = a.double(), b.double()
    finite = a64[torch.isfinite(a64)]  # the scale of the finite values; inf and NaN compared by place
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return bool(torch.allclose(a64, b64, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True))


_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


def same_plain(a: Any, b: Any) -> bool:
    """Whether two plain values are the same: the same object, or of one type and equal (a
    value whose ``==`` fails or is not a bool, such as an array, only as the same object)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == is not a bool
        return False


def concatenated_dim(whole: Any, parts: Sequence[Any], exact: bool = False) -> Optional[int]:
    """The dim along which ``parts`` concatenate to ``whole`` (value included: within the
    tolerance, or bit for bit with ``exact``), or None."""
    if not isinstance(whole, Tensor) or not all(isinstance(p, Tensor) for p in parts) or len(parts) < 2:
        return None
    for d in range(whole.dim()):
        if all(p.dim() == whole.dim() and p.shape[:d] == whole.shape[:d] and p.shape[d + 1:] == whole.shape[d + 1:]
               for p in parts) and sum(p.shape[d] for p in parts) == whole.shape[d]:
            joined = torch.cat(list(parts), dim=d)
            return d if (exactly_same(whole, joined) if exact else same_value(whole, joined)) else None
    return None


def kept_for_comparison(value: Any) -> Any:
    """A non-tensor input as the graph baked it: a copy where its type compares by value (a
    ``SimpleNamespace`` of options, a dataclass), so that the same object changed in place
    before a later call is seen to differ (it was compared with itself, silently: a trial);
    the object itself where it compares by identity, or cannot be copied."""
    if type(value).__eq__ is object.__eq__:
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - compared as the object itself
        return value
