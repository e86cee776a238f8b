"""Output sizes of a torch.export graph's nodes, read from its traced values, without running it.

Why: ``balance_by='params'`` (and ``'memory'``) needs each node's output bytes and shape on the
profiled inputs, and running the graph for them cost GPT-2 124M's build half a second, a sixth
of an eager training step (issue 31). torch.export already records every node's output as a fake
tensor (``node.meta['val']``) whose sizes are expressions in the input sizes it kept dynamic
(``s0``, ``s1``): binding those symbols to the profiled inputs' sizes gives the sizes a run would
see. Where that cannot be done -- a node without a traced value (an fx capture, a module kept
opaque), a size the data decides (``nonzero``'s unbacked ``u0``), an input whose size is not a
plain symbol -- :func:`traced_sizes` returns None and the caller runs the graph as before.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["traced_sizes"]


class _Unknown(Exception):
    """A size the inputs do not decide."""


class _Sizes:
    """Symbolic sizes evaluated at bound input sizes (one evaluation per distinct expression)."""

    def __init__(self, binding: Dict[sympy.Symbol, int]) -> None:
        self.binding = binding
        self.done: Dict[Any, Any] = {}

    def value(self, s: Any) -> Any:
        if not isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return s
        expr = s.node.expr
        if expr not in self.done:
            out = sympy.sympify(expr.xreplace(self.binding))
            if not out.is_number:
                raise _Unknown(str(out))
            self.done[expr] = bool(out) if isinstance(s, torch.SymBool) else (
                int(out) if isinstance(s, torch.SymInt) else float(out))
        return self.done[expr]

    def concrete(self, val: Any) -> Any:
        """``val`` with its fake tensors as meta tensors of the evaluated shape (what
        :func:`~fxpipe.plan._profile.tensor_bytes` and ``shape_str`` read) and its symbolic
        numbers evaluated."""
        def one(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return torch.empty([self.value(d) for d in v.shape], dtype=v.dtype, device="meta")
            return self.value(v)
        return pytree.tree_map(one, val)


def _binding(gm: fx.GraphModule, flat: Sequence[Any]) -> Dict[sympy.Symbol, int]:
    """Each input size symbol bound to the size of the input it was traced from."""
    binding: Dict[sympy.Symbol, int] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise _Unknown("inputs")
    for node, x in zip(placeholders, flat):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != val.dim():
            raise _Unknown(node.name)
        for traced, size in zip(val.shape, x.shape):
            expr = traced.node.expr if isinstance(traced, torch.SymInt) else sympy.Integer(traced)
            if isinstance(expr, sympy.Symbol) and binding.get(expr, size) == size:
                binding[expr] = int(size)
            elif not (expr.is_number and int(expr) == size):  # a size fixed at another, or not a symbol
                raise _Unknown(node.name)
    return binding


def traced_sizes(gm: fx.GraphModule, flat: Sequence[Any]) -> Optional[Dict[str, Any]]:
    """``{node name: its output at flat's sizes}`` for every node, as a run gives it to
    :class:`fxpipe.plan._profile` (placeholders: the inputs; the output node: the outputs; the
    rest: meta tensors and numbers, :meth:`_Sizes.concrete`), or None where a node has no traced
    value or a size the inputs do not decide (see the module docstring)."""
    try:
        sizes = _Sizes(_binding(gm, flat))
        out: Dict[str, Any] = {}
        inputs = iter(flat)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                out[n.name] = next(inputs)
            elif n.op == "output":
                out[n.name] = fx.node.map_arg(n.args[0], lambda a: out[a.name])
            elif "val" not in n.meta:
                return None
            else:
                out[n.name] = sizes.concrete(n.meta["val"])
        return out
    except (_Unknown, TypeError, ValueError, RuntimeError):
        return None
