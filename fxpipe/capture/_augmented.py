"""Augmented assignment (``h += x``) recorded as Python runs it: in place on tensors.

``torch.fx.Proxy`` has no ``__iadd__``, so Python falls back to ``__add__`` and fx records
``h += x`` as ``h = h + x``. That is not the same computation: the in-place op keeps
``h``'s dtype (under autocast a bfloat16 ``h`` plus a float32 ``x`` stays bfloat16, where
``h + x`` is float32), and every other name of ``h`` sees the change. fxpipe's tracer hands
out :class:`AugmentedProxy` instead, which records ``h += x`` as ``iadd(h, x)``: a call of
``operator.iadd``, i.e. ``type(h).__iadd__`` when it exists (in place, tensors) and ``h + x``
when it does not (ints from ``x.size()``, floats, tuples). The graph then runs exactly what
the model ran, and :mod:`fxpipe.capture._mutation` finds the tensor ones by their version counters
and makes them safe to cut like any other in-place op.

Why functions of this module rather than ``operator.iadd`` itself as the node target: fx
prints ``operator.iadd`` nodes as ``h += x; iadd = h``, which rebinds the name ``h`` in the
generated code, so a later use of the old ``h`` reads the new value -- wrong for an int,
whose ``+=`` makes a new object. A plain call keeps both values.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from torch import fx

__all__ = ["AugmentedProxy", "AUGMENTED"]


def _augmented(name: str) -> Callable[[Any, Any], Any]:
    op = getattr(operator, name)

    def run(a: Any, b: Any) -> Any:
        return op(a, b)

    run.__name__ = run.__qualname__ = name
    run.__module__ = __name__
    run.__doc__ = f"``a {_SYMBOLS[name]} b`` as Python runs it (``operator.{name}``): in place when ``a`` can be."
    return run


_SYMBOLS = {"iadd": "+=", "isub": "-=", "imul": "*=", "itruediv": "/=", "ifloordiv": "//=", "imod": "%=",
            "ipow": "**=", "imatmul": "@=", "iand": "&=", "ior": "|=", "ixor": "^=", "ilshift": "<<=",
            "irshift": ">>="}

#: name -> the function recorded for ``a <op>= b`` (importable here as ``fxpipe.capture._augmented.<name>``).
AUGMENTED: dict[str, Callable[[Any, Any], Any]] = {name: _augmented(name) for name in _SYMBOLS}
globals().update(AUGMENTED)  # generated code and pickled graphs name them by module and name


class AugmentedProxy(fx.Proxy):
    """An fx proxy whose ``a <op>= b`` is recorded as the augmented op, not ``a = a <op> b``.

    It also records item assignment (``x[i] = v``, and so ``x[a:b] += y``, which Python
    runs as a getitem, the augmented op on that view, then a setitem back) as a call of
    ``operator.setitem``: fx's own proxies refuse it, which sent such models to torch.export.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _define(name: str) -> None:
    target = AUGMENTED[name]

    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", target, (self, other), {})

    method.__name__ = method.__qualname__ = f"__{name}__"
    setattr(AugmentedProxy, f"__{name}__", method)


for _name in AUGMENTED:
    _define(_name)
