"""A forward that assigns a parameter's ``.data`` anew, in code the capture traced: refused.

A weight constraint written as ``self.weight.data = torch.renorm(self.weight.data, 2, 0, 0.5)``
(braindecode's ``LinearWithConstraint``) swaps the tensor under the parameter at every call.
torch.fx and torch.export record tensor operations, not that assignment: the stages would
never apply the constraint, and the pipeline silently computes another model from its first
call (a trial: 0.098 off in outputs, 0.39 in gradients). An in-place write
(``with torch.no_grad(): self.weight.renorm_(...)``) is recorded and stays exact; a module
kept opaque runs its own forward, assignment included, at each call. The build's eager run of
the model shows the swap: the parameter's storage is another one after it.
"""

from __future__ import annotations

from typing import List, Sequence

from torch import nn

from ..capture._fx_trace import is_standard_layer
from ..errors import MutationError

__all__ = ["DataSwaps"]


class DataSwaps:
    """The storage of each of ``model``'s parameters when made; :meth:`refuse` after an eager
    run of the model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seen = [(name, p, p.data_ptr()) for name, p in model.named_parameters()]

    def refuse(self, leaves: Sequence[str]) -> None:
        """Raises :class:`MutationError` naming the parameters whose ``.data`` the run assigned
        anew in code the capture traced (not inside a module kept opaque: ``leaves`` or a
        torch.nn layer)."""
        swapped = [name for name, p, ptr in self.seen if p.data_ptr() != ptr]
        traced = [name for name in swapped if not self._opaque_owner(name, leaves)]
        if traced:
            owner = traced[0].rpartition(".")[0]
            raise MutationError(
                f"the forward assigns {', '.join(repr(n + '.data') for n in traced[:3])} anew at each call (a weight "
                "constraint such as self.weight.data = torch.renorm(...)): torch.fx and torch.export record tensor "
                "operations, not that assignment, so the pipeline would never apply it and would silently compute "
                "another model. What to do: write it in place, with torch.no_grad(): self.weight.copy_(torch.renorm("
                f"self.weight, ...)), or keep the module opaque with leaf_modules=[{owner!r}] (it then runs its own "
                "forward, assignment included)")

    def _opaque_owner(self, name: str, leaves: Sequence[str]) -> bool:
        parts = name.split(".")[:-1]
        paths: List[str] = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
        if any(p in leaves for p in paths):
            return True
        try:
            return bool(parts) and is_standard_layer(self.model.get_submodule(".".join(parts)))
        except AttributeError:
            return False
