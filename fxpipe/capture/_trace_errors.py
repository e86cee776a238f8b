"""Why a capture failed, said as a :class:`~fxpipe.errors.TraceError` a user can act on.

Both strategies of :mod:`._tracing` failing leave two torch exceptions deep in tracer
internals; the user needs the module, the source line in their model, a reason in words
and what to do (usually ``leaf_modules=[...]``). This module turns failures into that.
"""

from __future__ import annotations

import traceback

from torch import nn

from ..errors import TraceError
from ._export import _Failure
from ._user_code import is_user_file

__all__ = ["trace_error", "output_error", "lost_records_error", "user_frame", "reason_of", "describe",
           "checkpointing_todo"]


def user_frame(exc: BaseException) -> str:
    """'file:line: code' of the innermost frame outside torch, fxpipe and the stdlib."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if not is_user_file(fr.filename):
                continue
            return f"{fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return ""


_REASONS = [
    ("cannot be used as inputs to control flow", "data-dependent control flow: a tensor was used as a Python bool"),
    ("data-dependent", "data-dependent control flow: a value computed from tensor data decides the Python code path"),
    ("guard on", "data-dependent control flow: a value computed from tensor data decides the Python code path"),
    ("cannot be iterated", "iteration over a traced tensor (for-loop / unpacking of unknown length)"),
    ("'len' is not supported", "len() of a traced tensor"),
    ("in output, which is not a known type", "the model returns an object that is neither a tensor nor a pytree "
     "container (for transformers models pass use_cache=False / return_dict outputs without caches)"),
    ("co_varnames is too small", "torch.fx cannot trace a forward with **kwargs on this Python version"),
]


def reason_of(exc: BaseException) -> str:
    text = str(exc)
    for needle, reason in _REASONS:
        if needle in text:
            return reason
    return f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"


def describe(model: nn.Module, path: str) -> str:
    try:
        cls = type(model.get_submodule(path))
    except AttributeError:
        cls = type(model)
    return f"'{path}' ({cls.__module__}.{cls.__qualname__})" if path else f"the root module ({type(model).__qualname__})"


def trace_error(model: nn.Module, fx_fail: _Failure, ex_fail: _Failure | None) -> TraceError:
    e = fx_fail.error
    loc = user_frame(e) or (user_frame(ex_fail.error) if ex_fail else "")
    reason = reason_of(e)
    if fx_fail.module:
        todo = f"pass leaf_modules=['{fx_fail.module}'] to keep it opaque (it then runs eagerly inside one stage)"
    else:
        todo = ("the failing code is in the root forward, which cannot be opaque: move it into a submodule "
                "and pass leaf_modules=['<that submodule>'], or avoid Python control flow on tensor values "
                "(e.g. torch.where)")
    lines = [f"fxpipe could not capture {type(model).__qualname__} (torch.fx and torch.export both failed).",
             f"  module:   {describe(model, fx_fail.module)}",
             f"  location: {loc or 'unknown'}",
             f"  reason:   {reason}"]
    if ex_fail is not None:
        lines.append(f"  torch.export: {reason_of(ex_fail.error)}")
    if fx_fail.auto:
        lines.append(f"  already kept opaque automatically: {fx_fail.auto}")
    lines.append(f"What to do: {todo}.")
    return TraceError("\n".join(lines), module=fx_fail.module, location=loc, reason=reason)


def output_error(model: nn.Module, bad: str) -> TraceError:
    name = type(model).__qualname__
    reason = f"the output holds {bad}, which fxpipe cannot gather over micro-batches and return as eager does"
    if "transformers" in bad:
        todo = ("pass use_cache=False (in the model's config, or sample_kwargs={'use_cache': False} and the "
                "same keyword in every call) so that no cache is returned")
    else:
        todo = f"make {name}.forward return tensors (or tuples, dicts, dataclasses of them) instead"
    return TraceError(f"fxpipe cannot pipeline {name}: {reason}.\nWhat to do: {todo}.", reason=reason)


def lost_records_error(modules: list[str], error: BaseException) -> TraceError:
    """torch.fx kept ``modules`` whole, and transformers records their outputs with a hook that
    runs only while the model's own forward does; torch.export, which would run it, failed."""
    names = ", ".join(map(repr, modules[:3])) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
    reason = "transformers records their outputs with hooks that run only inside the model's own forward"
    return TraceError(
        f"{names} would be kept whole by torch.fx, and {reason} (output_hidden_states, output_attentions, ...): "
        f"the pipeline would return those outputs without their entries. torch.export, which runs them, failed: "
        f"{reason_of(error)}. What to do: leave those outputs out of the call (and the config), or make "
        "the modules traceable (remove them from leaf_modules; a transformers config change such as "
        "attn_implementation='sdpa' or use_cache=False often does it).", module=modules[0], reason=reason)


def checkpointing_todo(model: nn.Module) -> str:
    """What to do where transformers' gradient checkpointing is on, or '': its layers ask
    torch.is_grad_enabled() at each call, so torch.export (which would fix the answer) is not
    used and torch.fx keeps what it cannot trace opaque -- a trial's whole LlamaModel, one
    stage holding every layer, with a warning about a mask's ``if`` and advice about
    ``use_cache`` instead."""
    if not getattr(model, "is_gradient_checkpointing", False):
        return ""
    return ("The model has gradient checkpointing on (transformers' gradient_checkpointing_enable): its layers ask "
            "torch.is_grad_enabled() at each call, which torch.export would fix, so the capture is torch.fx's. What "
            "to do: model.gradient_checkpointing_disable() before the build, and checkpoint='always' for fxpipe's "
            "own recomputation of each stage in backward")
