"""Which graphs can write a tensor in place, read from their ops' schemas, without running them.

The in-place search (:mod:`fxpipe.capture._mutation`) runs the graph on the sample, a forward of
the model at every build, to see what each node writes. A torch.export graph of a model without
buffer updates or in-place ops (GPT-2, Llama, BERT: 16 of the 21 transformers families tested)
calls only aten ops whose schemas declare no written argument, and size arithmetic: it has
nothing to find, and is not run.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["writes_nothing"]

#: aten ops that update their running-statistics arguments without declaring it in their schema
_UNDECLARED_WRITERS = ("batch_norm", "instance_norm")
#: Python functions an export graph calls on sizes (SymInts), none of which writes
_PURE_PYTHON = {operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
                operator.mod, operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le,
                operator.gt, operator.ge, operator.and_, operator.or_, operator.not_}


def writes_nothing(gm: fx.GraphModule) -> bool:
    """Whether no node of ``gm`` can change a tensor in place, read from the ops' schemas: every
    call is an aten op whose schema declares no written argument (and not one of the few that
    write undeclared), or size arithmetic. A torch.export graph of a model without buffer
    updates or in-place ops is such a graph (GPT-2, Llama, BERT); an fx graph calls modules
    and Python functions, which only running them can tell about."""
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        target = n.target
        if n.op != "call_function":
            return False
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace != "aten" or any(w in target.name() for w in _UNDECLARED_WRITERS) \
                    or any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
                return False
        elif target not in _PURE_PYTHON:
            return False
    return True
