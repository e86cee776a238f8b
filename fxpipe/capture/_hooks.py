"""Module hooks under a graph capture.

torch.fx and torch.export call a traced module's hooks once, while tracing: what a hook
returns is recorded into the graph, but what it does (collect features for a perceptual
loss, log, count) happens then and never again, and a backward hook is lost. A module with
hooks is therefore kept opaque: its ``__call__``, hooks included, runs inside its stage on
each micro-batch (and again when a checkpointed stage recomputes, as with torchgpipe).
Standard torch.nn layers are opaque anyway. The model's own (root) hooks cannot be kept:
the pipeline calls the stages, never the model, so they are refused; the pipeline is a
module, and hooks registered on it run around each call.
"""

from __future__ import annotations

import warnings
from typing import Callable, List

from torch import nn

from ..errors import TraceError

__all__ = ["has_hooks", "hooked_modules"]


def has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def hooked_modules(model: nn.Module, already_opaque: Callable[[nn.Module], bool]) -> List[str]:
    """Qualified names of the submodules to keep opaque for their hooks (a warning says so);
    :class:`TraceError` when the model itself has hooks."""
    if has_hooks(model):
        raise TraceError(
            f"{type(model).__name__} itself has forward or backward hooks: a pipeline runs its stages, never "
            "the model's own __call__, so they would not run. What to do: register them on the pipeline "
            "(pipe = fxpipe.pipeline(...); pipe.register_forward_hook(...)), or on a submodule.",
            reason="hooks on the root module")
    names = [name for name, m in model.named_modules() if name and has_hooks(m) and not already_opaque(m)]
    outermost = [n for n in names if not any(n.startswith(p + ".") for p in names)]
    for name in outermost:
        warnings.warn(f"fxpipe: {name!r} ({type(model.get_submodule(name)).__name__}) has hooks: kept opaque, so "
                      "they run on each of its calls instead of once while tracing: once per micro-batch, "
                      "seeing that micro-batch (not the whole batch), and again when a checkpointed stage "
                      "recomputes (fxpipe.runtime._checkpoint.is_recomputing() tells the two "
                      "apart)", stacklevel=3)
    return outermost
