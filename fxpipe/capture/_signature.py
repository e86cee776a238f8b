"""Whether a sample fits ``model.forward``, said before anything is traced.

A sample with one input too many reaches torch.fx and torch.export, both fail on the call
itself (``forward() takes 2 positional arguments but 4 were given``), and the capture's
refusal then gives the advice made for untraceable code: move it into a submodule, avoid
control flow. So the sample is bound to the forward signature first, and a mismatch is
refused saying how many inputs the model takes and how many it was given.
"""

from __future__ import annotations

import inspect
from typing import Optional

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["sample_mismatch", "inputs_text"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(model: nn.Module) -> Optional[inspect.Signature]:
    if model._forward_pre_hooks or _module._global_forward_pre_hooks:
        return None  # a pre-hook may rewrite the arguments: only the call itself can tell
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C-level forward: nothing to read
        return None


def inputs_text(model: nn.Module) -> str:
    """How many positional inputs ``model.forward`` takes, and their names: 'takes 1 input (x)',
    'takes 1 to 2 inputs (x, mask=None)', 'takes at least 1 input (x, *rest)'; '' if unknown."""
    sig = _signature(model)
    if sig is None:
        return ""
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    var = next((p for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    names = ", ".join([p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                       for p in positional] + ([f"*{var.name}"] if var else []))
    if var is not None:
        count = f"at least {required}"
    elif required == len(positional):
        count = str(required)
    else:
        count = f"{required} to {len(positional)}"
    plural = "input" if count in ("1", "at least 1") else "inputs"
    return f"takes {count} positional {plural} ({names})"


def sample_mismatch(model: nn.Module, args: tuple, kwargs: dict) -> str:
    """'' when ``model.forward`` accepts ``(*args, **kwargs)`` (or cannot be asked); else a
    sentence saying what it takes and what it was given."""
    sig = _signature(model)
    if sig is None:
        return ""
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        given = f"{len(args)} positional input{'s' if len(args) != 1 else ''}"
        if kwargs:
            given += f" and keyword{'s' if len(kwargs) != 1 else ''} {', '.join(sorted(kwargs))}"
        return f"{type(model).__name__}.forward {inputs_text(model)} but was given {given} ({e})"
    return ""
