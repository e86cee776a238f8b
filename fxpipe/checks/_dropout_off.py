"""torch's dropout as the identity while the build's training-mode checks run.

The training-mode check compares the whole batch with its micro-batches merged; a graph that
draws random numbers there is compared for structure only, since the micro-batches draw other
masks. Dropout is by far the commonest draw, and a functional one (``F.dropout(h, p,
self.training)``, as transformers' attention writes it; an export graph's ``aten.dropout``)
stays random when the check switches dropout modules off, so batch mixing anywhere in such a
model went unchecked in training mode (a trial: ``h - h.mean(0)`` under ``if self.training``,
0.47 off, built because of a dropout in another module). With every dropout op the identity
(:func:`dropout_off`) a model that draws nothing else is compared value for value.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["dropout_off"]

_aten = torch.ops.aten
_IDENTITY = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout,
             _aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default}


class _NoDropout(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in _IDENTITY:
            return args[0] if args else (kwargs or {})["input"]
        if func is _aten.native_dropout.default:
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        return func(*args, **(kwargs or {}))


@contextmanager
def dropout_off() -> Iterator[None]:
    """While the block runs (this thread), every dropout op of torch returns its input."""
    with _NoDropout():
        yield
