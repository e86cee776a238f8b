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

from typing import Any, List, Sequence, Set, Tuple

from torch import nn

from ..errors import MutationError

__all__ = ["DataSwaps"]


class DataSwaps:
    """The storage of each of ``model``'s parameters when made, and which swaps happen inside
    a call of a module kept opaque (``leaves``: it runs its own forward, assignment included,
    at each call); :meth:`refuse` after an eager run of the model. A swap a traced parent makes
    on an opaque layer's weight (``self.fc.weight.data = F.normalize(...)``, a cosine head) is
    the traced code's and refused (a review: exempted by the owner's kind, it ran 2.67 off)."""

    def __init__(self, model: nn.Module, leaves: Sequence[str]) -> None:
        self.seen = [(name, p, p.data_ptr()) for name, p in model.named_parameters()]
        self.inside: Set[int] = set()  # ids of parameters swapped during an opaque module's own call
        self._handles = []
        for path in leaves:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))
        self._open: List[List[Tuple[nn.Parameter, int]]] = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._open.append([(p, p.data_ptr()) for p in module.parameters()])

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        for p, ptr in self._open.pop() if self._open else []:
            if p.data_ptr() != ptr:
                self.inside.add(id(p))

    def refuse(self) -> None:
        """Removes the hooks; raises :class:`MutationError` naming the parameters whose
        ``.data`` the run assigned anew outside an opaque module's own call."""
        for h in self._handles:
            h.remove()
        self._handles = []
        traced = [name for name, p, ptr in self.seen if p.data_ptr() != ptr and id(p) not in self.inside]
        if traced:
            owner = traced[0].rpartition(".")[0]
            raise MutationError(
                f"the forward assigns {', '.join(repr(n + '.data') for n in traced[:3])} anew at each call (a weight "
                "constraint such as self.weight.data = torch.renorm(...)): torch.fx and torch.export record tensor "
                "operations, not that assignment, so the pipeline would never apply it and would silently compute "
                "another model. What to do: write it in place, with torch.no_grad(): self.weight.copy_(torch.renorm("
                f"self.weight, ...)), or keep the module that assigns it opaque with leaf_modules=[...] (it then runs "
                f"its own forward, assignment included; {owner!r} if it is the one)")
