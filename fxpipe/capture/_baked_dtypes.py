"""Parameters and buffers given another floating dtype after a build whose graph names dtypes.

A torch.export graph writes dtypes into its ops as constants (GPT-2's attention mask made in
``float32``, ``aten.to(..., dtype=torch.float32)``). ``model.to(torch.bfloat16)`` or
``pipe.to(torch.bfloat16)`` after such a build changes the parameters in place, the stages
see the new tensors, and the baked ``float32`` meets them: a bare ``RuntimeError: mixed
dtype`` from deep inside torch at best, a silent upcast at worst. :class:`BakedDtypes`
records the floating dtype of every parameter and buffer when the captured graph names a
floating dtype, and refuses a call after any of them changed with
:class:`~fxpipe.errors.ModelChangedError`, saying to build again after ``.to(dtype)`` (or to
build under ``torch.autocast``, which the graph follows). A graph naming no floating dtype,
and every torch.fx capture (which calls the model's own code, ``self.dtype`` included), check
nothing.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import fx, nn

from ..errors import ModelChangedError

__all__ = ["BakedDtypes"]


def _names_float_dtype(graph: fx.GraphModule) -> bool:
    for node in graph.graph.nodes:
        for value in (*node.args, *node.kwargs.values()):
            if isinstance(value, torch.dtype) and value.is_floating_point:
                return True
    return False


class BakedDtypes:
    """The floating dtypes of ``model``'s tensors at the build, when ``method`` is
    ``'export'`` and ``graph`` names a floating dtype ('' otherwise: nothing to check)."""

    def __init__(self, model: nn.Module, graph: fx.GraphModule, method: str) -> None:
        watched = method == "export" and _names_float_dtype(graph)
        self._tensors: List[Tuple[torch.Tensor, str, torch.dtype]] = [
            (t, name, t.dtype) for name, t in (*model.named_parameters(), *model.named_buffers())
            if t.is_floating_point()] if watched else []

    def check(self) -> None:
        """Raises :class:`~fxpipe.errors.ModelChangedError` naming the tensors whose dtype
        changed since the build."""
        for t, _, dtype in self._tensors:  # the common case: identity tests
            if t.dtype is not dtype:
                break
        else:
            return
        changed = [f"'{name}' is {t.dtype} now, was {dtype}" for t, name, dtype in self._tensors if t.dtype is not dtype]
        shown = changed[:4] + ([f"... and {len(changed) - 4} more"] if len(changed) > 4 else [])
        raise ModelChangedError(
            "the model's parameters or buffers have another dtype than at the build, and its graph, captured with "
            "torch.export, has dtypes written into its ops (a mask or cast made in the old dtype): it would fail "
            "with mixed dtypes or silently compute in the old one. Build the pipeline again after .to(dtype) "
            "(fxpipe.pipeline(model, ...)), or keep the weights and run under torch.autocast. What changed:\n"
            + "\n".join(f"  - {c}" for c in shown), changes=changed)
