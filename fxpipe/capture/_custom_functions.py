"""Custom ``torch.autograd.Function`` calls in a model being captured.

``Fn.apply(x)`` runs ``Fn.forward`` under no_grad and attaches ``Fn.backward`` to its
outputs. A capture that traces *through* ``apply`` records the forward's operations only,
so the stage would differentiate those instead of ``Fn.backward``: a straight-through
estimator's gradient becomes 0, a gradient reversal keeps its sign, a custom kernel's
hand-written backward is replaced -- silently. So while fxpipe captures:

* under torch.fx, each ``Fn.apply(...)`` on traced values becomes **one** graph node that
  calls ``Fn.apply`` when the stage runs. The Function then runs whole, its backward (and
  its ``ctx``: saved tensors, ``mark_dirty``, ``needs_input_grad``) included, in forward and
  in recomputation: exact, wherever the call sits (root forward or submodule);
* under torch.export (used when fx cannot trace the root), the graph is aten operations and
  cannot hold the call, so a Function applied outside a module kept opaque is refused with
  :class:`AutogradFunctionError`, naming it, its line and what to do. Inside an opaque module
  (``leaf_modules``) the module's own forward runs at call time: exact, so allowed. torch's
  own Functions, which torch.export applies while it traces higher-order ops, are left to it.

Subclasses that define their own ``apply`` (torch's re-entrant checkpoint, handled by
:mod:`fxpipe.capture._reentrant`) are not affected. The patch is thread-local in effect: other threads
calling ``apply`` meanwhile get torch's own.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ._apply_patch import ApplyPatch, error_in_chain
from ._opaque_calls import OpaqueCalls
from ._user_code import user_line

__all__ = ["AutogradFunctionError", "applying_as_nodes", "refusing_in_export", "autograd_function_in",
           "function_of"]

_Function = torch.autograd.function.Function
_lock = threading.Lock()
_targets: Dict[type, Callable[..., Any]] = {}


class AutogradFunctionError(TraceError):
    """A custom ``torch.autograd.Function`` is applied where the capture cannot keep it whole."""


def _node_target(cls: type) -> Callable[..., Any]:
    """The graph's callable for ``cls.apply``: one per Function class, so stage code is stable.

    Named ``<Function>_apply`` and placed in the Function's own module, so generated code
    reads as the model's (and :mod:`fxpipe.runtime._randomness` treats it as user code, which
    may draw random numbers). A Function defined in torch or fxpipe is renamed out of those
    packages: fx would otherwise import it by a dotted path that does not exist.
    """
    with _lock:
        target = _targets.get(cls)
        if target is None:
            def apply(*args: Any, **kwargs: Any) -> Any:
                return cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

            module = cls.__module__
            if module.partition(".")[0] in ("torch", "fxpipe"):
                module = f"autograd_function_{module.replace('.', '_')}"
            apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
            apply.__module__ = module
            apply.fxpipe_autograd_function = cls  # type: ignore[attr-defined]
            target = _targets[cls] = apply
    return target


def function_of(target: Any) -> type | None:
    """The autograd Function class a graph node's target applies, or None."""
    return getattr(target, "fxpipe_autograd_function", None)


def _from_torch(cls: type) -> bool:
    """torch's own Functions (the autograd wrappers of higher-order ops such as ``cond``, which
    torch.export applies while it traces them) are torch.export's to capture, not the model's."""
    return cls.__module__.partition(".")[0] == "torch"


def _refusal(cls: type) -> AutogradFunctionError:
    location = user_line()
    name = f"{cls.__module__}.{cls.__qualname__}"
    return AutogradFunctionError(
        f"the model applies the custom autograd.Function {name}"
        + (f" ({location})" if location else "")
        + " in code that torch.fx could not trace, and torch.export (the fallback) records only the "
        "Function's forward operations: the stage would differentiate those instead of its backward, "
        "so the gradients would be wrong. What to do: make the forward that applies it traceable by "
        "torch.fx (fxpipe then keeps the Function whole, backward included), or move the call into a "
        "submodule and pass leaf_modules=['<that submodule>'] to keep it opaque.",
        location=location, reason=f"custom autograd.Function {cls.__qualname__} under torch.export")


def _patched_apply(patch: ApplyPatch, cls: type, *args: Any, **kwargs: Any) -> Any:
    mode = patch.state
    if mode is not None and mode[0] == "fx":
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs))):
            return mode[1].create_proxy("call_function", _node_target(cls), args, kwargs)
    elif mode is not None and mode[0] == "export" and not _from_torch(cls) and not mode[1].inside:
        raise _refusal(cls)
    return patch.original(cls, *args, **kwargs)


_PATCH = ApplyPatch(_Function, _patched_apply)


def applying_as_nodes(tracer: fx.Tracer) -> Any:
    """While the block runs, ``Fn.apply`` on ``tracer``'s proxies records one node (see module doc)."""
    return _PATCH.active(("fx", tracer))


def refusing_in_export(opaque: OpaqueCalls) -> Any:
    """While the block runs, ``Fn.apply`` outside the calls of the modules kept opaque
    (``opaque``, active around the same block) raises :class:`AutogradFunctionError` (see
    module doc)."""
    return _PATCH.active(("export", opaque))


def autograd_function_in(error: BaseException | None) -> AutogradFunctionError | None:
    """The :class:`AutogradFunctionError` behind a capture failure, if any (torch.export may
    wrap or chain it)."""
    return error_in_chain(error, AutogradFunctionError)
