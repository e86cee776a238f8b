"""A step's own gradient, apart from what ``.grad`` accumulated before it.

Gradients summed over ranks after a step -- a tied weight's over the ranks using it
(:mod:`._ties`), every gradient over the data-parallel replicas (:mod:`._replicas`) -- must
sum only that step's gradient: summing the whole accumulated ``.grad`` would count earlier
steps once per rank. So what ``.grad`` held is set aside before the step and added back after
the sum (in place, as autograd accumulates), or put back as it was when the step failed.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

__all__ = ["SetAside"]


class SetAside:
    """The ``.grad`` of some parameters, set aside for one step."""

    def __init__(self) -> None:
        self._saved: dict[int, Optional[torch.Tensor]] = {}

    def take(self, parameters: Iterable[nn.Parameter]) -> None:
        """Before the step: each ``.grad`` set aside, ``None`` in its place."""
        for p in parameters:
            self._saved[id(p)] = p.grad
            p.grad = None

    def restore(self, parameters: Iterable[nn.Parameter]) -> None:
        """After a failed step: the gradients set aside go back, as they were."""
        for p in parameters:
            if id(p) in self._saved:
                p.grad = self._saved.pop(id(p))

    def add_back(self, p: nn.Parameter) -> None:
        """After the step's own gradient was summed: what was set aside added to it (a
        parameter that got none keeps what it had)."""
        saved = self._saved.pop(id(p), None)
        if saved is not None:
            p.grad = saved if p.grad is None else saved.add_(p.grad)
