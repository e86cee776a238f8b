"""When a ``loss_fn``'s cached reading may serve a later call: the key of what the loss reads.

:class:`fxpipe.checks._loss_fn.LossFnReading` reads a loss once per micro-batch shape and
bakes the values its counts' code read into that reading; a loop that changes the loss
(another reduction, class weights, a config switched between steps) must get a new one.
:func:`loss_key` is what makes two calls' ``loss_fn`` the same loss.
"""

from __future__ import annotations

import functools
import types
from typing import Any, List, Tuple

import torch
from torch import Tensor

__all__ = ["loss_key", "function_reads", "DEPTH"]


#: how deep :func:`loss_key` looks into the containers and objects a loss reads (a nested
#: config dict ``cfg['opts']['sum']`` switched between steps was reused stale at one level)
DEPTH = 3


def loss_key(loss_fn: Any) -> Any:
    """What makes two calls' ``loss_fn`` the same loss, for the cached reading (which holds
    the counts' code with the values it read baked in): the function's code and defaults, and
    every value it can read that a loop may change, each by identity, plain values by value
    and tensors with their version counter (an in-place change): the objects its closure
    holds, the globals its code names, a bound method's object's attributes, a callable
    object's attributes (``nn.CrossEntropyLoss``'s ``weight`` and ``ignore_index``), and the same
    of the Python functions and callable objects it reaches there (a helper reading a length from
    a config dict), three levels deep. A lambda made anew each step with the same code and values
    is the same loss. A
    ``functools.partial`` is its function with its arguments; a container or plain object it
    names (a config dict, an ``argparse.Namespace``) by its contents, three levels deep; an
    ``nn.Module`` criterion by every submodule's settings."""
    if isinstance(loss_fn, functools.partial):
        return ("partial", loss_key(loss_fn.func), tuple(_value(a) for a in loss_fn.args),
                tuple((k, _value(v)) for k, v in sorted(loss_fn.keywords.items())))
    fn = getattr(loss_fn, "__func__", loss_fn)
    owner = getattr(loss_fn, "__self__", None)
    code = getattr(fn, "__code__", None)
    if isinstance(loss_fn, torch.nn.Module):  # a criterion module: its submodules' settings too
        return ("object", type(loss_fn), _value(loss_fn))
    if code is None:  # a callable object: its class's __call__ reads its attributes
        return ("object", type(loss_fn), _state(vars(loss_fn)) if hasattr(loss_fn, "__dict__") else id(loss_fn))
    return ("function", *_function_key(fn, 0),
            _state(vars(owner)) if owner is not None and hasattr(owner, "__dict__") else id(owner))


def function_reads(fn: Any) -> Tuple[List[Tuple[str, Any]], List[Tuple[str, Any]]]:
    """What a Python function reads besides its arguments: its closure's filled cells and the
    globals its code names (modules and builtins left out), each ``(name, value)``."""
    code = fn.__code__
    cells = [(name, c.cell_contents) for name, c in zip(code.co_freevars, fn.__closure__ or ()) if _filled(c)]
    names = getattr(fn, "__globals__", {})
    return cells, [(n, names[n]) for n in code.co_names if n in names and not _module(names[n])]


def _function_key(fn: Any, depth: int) -> Tuple[Any, ...]:
    """A Python function as a key: its code, closure, the globals its code names, defaults."""
    cells, names = function_reads(fn)
    defaults = tuple(_value(d, depth) for d in (fn.__defaults__ or ()))
    return (fn.__code__, tuple(_value(v, depth) for _, v in cells), tuple((n, _value(v, depth)) for n, v in names),
            defaults)


def _module(value: Any) -> bool:
    import types
    return isinstance(value, types.ModuleType) or callable(value) and not isinstance(value, Tensor) \
        and not hasattr(value, "__dict__")


def _value(x: Any, depth: int = 0) -> Any:
    """A value as a key: plain ones themselves, a tensor by identity and version, a module
    (nn.Module) by its own and its submodules' parameters, buffers and plain attributes, a small container or a
    plain object (a config) by its contents, down to :data:`DEPTH` levels; anything else by identity."""
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return (type(x), x)
    if isinstance(x, Tensor):
        return ("tensor", id(x), x._version)
    if depth > DEPTH:
        return ("id", id(x))
    if isinstance(x, (tuple, list)) and len(x) <= 16:
        return (type(x), tuple(_value(v, depth + 1) for v in x))
    if isinstance(x, dict) and len(x) <= 64:
        return (dict, id(x), tuple((_value(k, DEPTH + 1), _value(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, torch.nn.Module):  # every submodule's (a criterion wrapping nn.CrossEntropyLoss)
        return ("module", id(x), tuple((name, id(m), _state(vars(m), depth + 1)) for name, m in x.named_modules()))
    if isinstance(x, types.FunctionType):  # a helper the loss calls, and what it reads (a trial: `y[:, :prompt_len()]`
        return ("function", id(x), *_function_key(x, depth + 1))  # with the length in a dict, read stale: nan)
    if hasattr(x, "__dict__") and not isinstance(x, type) and len(vars(x)) <= 64:  # a callable object's settings too
        return ("object", id(x), _state(vars(x), depth + 1))
    return ("id", id(x))


def _state(attrs: dict, depth: int = 1) -> Tuple[Any, ...]:
    """An object's attributes as a key (a module's registries included)."""
    out = []
    for name, v in attrs.items():
        if name in ("_parameters", "_buffers") and isinstance(v, dict):
            out.append((name, tuple((k, _value(t)) for k, t in v.items())))
        elif name.startswith("_") and name != "_modules":
            continue
        else:
            out.append((name, _value(v, depth)))
    return tuple(out)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
