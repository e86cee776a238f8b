"""The module globals a traced forward names: values a capture baked into its graph.

torch.fx and torch.export run the forward's Python once; a global it reads (``SCALE = 1.0``,
a ``CFG`` namespace of settings, a class attribute read through the class, ``K.alpha``) is
used then and becomes a literal of the graph. Changed afterwards (a curriculum, an annealed
temperature), the pipeline silently went on with the build's value (a trial: loss 0.1117
against 0.3223). :class:`GlobalReads` notes, for every module whose code was traced, the
globals its ``forward`` names that hold plain values, functions (by identity: a helper
reassigned, as kernel libraries patch, ran in eager and not in the graph), plain-valued
classes or objects of settings (their plain attributes), and :mod:`fxpipe.capture._model_check` compares them at
each call. A global read through a helper function of the model's is not seen (its code is
not the forward's): the docs say so.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import sys
import types
from typing import Any, Iterable, List, Tuple

from torch import nn

from ._attr_reads import is_plain

__all__ = ["GlobalReads"]

_MISSING = object()


def _settings(value: Any, home: str) -> bool:
    """Whether ``value`` is an object or class whose plain attributes a forward reads as
    settings: a namespace, a dataclass instance, or an object or class of the forward's own
    module (not a logger, a library's object)."""
    if isinstance(value, (types.SimpleNamespace, argparse.Namespace)) or dataclasses.is_dataclass(value):
        return True
    cls = value if isinstance(value, type) else type(value)
    return getattr(cls, "__module__", None) == home


#: globals a forward calls: the graph holds the ops they ran (fx inlines a function's code)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)


def _print(value: Any, kept: bool = False) -> Any:
    """What of a global's value a graph may have baked: itself where plain, the function
    itself (compared by identity: one reassigned after the build, a kernel library's patch,
    was silently left out, 0.51 off in a trial), else its public plain attributes (a class's,
    a namespace's), else None (not followed: a module, a method). ``kept``: copied, to hold
    from the build (compared at a call as it is)."""
    keep = copy.deepcopy if kept else (lambda v: v)
    if is_plain(value):
        return ("value", keep(value))
    if isinstance(value, _FUNCTIONS):
        return ("function", value)
    if isinstance(value, (types.ModuleType, types.MethodType)):
        return None
    attrs = value.__dict__ if isinstance(value, type) else getattr(value, "__dict__", None)
    if not isinstance(attrs, (dict, types.MappingProxyType)) or isinstance(value, nn.Module):
        return None
    if isinstance(value, type) and value.__module__.startswith(("torch", "builtins", "typing")):
        return None
    plain = tuple((k, keep(v)) for k, v in attrs.items() if not k.startswith("_") and is_plain(v))
    return ("attributes", plain) if plain else None


class GlobalReads:
    """The globals named by the ``forward`` of each of ``modules`` (see the module docstring)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        #: (module name where the global lives, global name, its print at the build)
        self.reads: List[Tuple[str, str, Any]] = []
        seen = set()
        for m in modules:
            fn = getattr(type(m), "forward", None)
            try:
                fn = inspect.unwrap(fn)  # a decorated forward: the code and globals of its own
            except ValueError:
                continue
            code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
            where = names.get("__name__") if isinstance(names, dict) else None
            if code is None or not isinstance(where, str) or where.startswith(("torch.", "fxpipe.")):
                continue
            for name in code.co_names:
                if (where, name) in seen or name not in names or name.startswith("__"):
                    continue
                seen.add((where, name))
                value = names[name]
                if not is_plain(value) and not isinstance(value, _FUNCTIONS) and not _settings(value, where):
                    continue
                p = _print(value, kept=True)
                if p is not None:
                    self.reads.append((where, name, p))

    def changes(self) -> List[str]:
        """A line per global whose value changed since the build."""
        out = []
        for where, name, was in self.reads:
            module = sys.modules.get(where)
            if module is None:
                continue  # a module no longer imported: nothing to compare with
            found = vars(module).get(name, _MISSING)
            now = _print(found) if found is not _MISSING else None
            if now != was:
                out.append(f"the global '{name}' of {where} (read by a traced forward) changed after the build: the "
                           "graph has the value it had then baked in")
        return out
