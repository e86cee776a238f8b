"""Module hooks under a graph capture.

torch.fx and torch.export call a traced module's hooks once, while tracing: what a hook
returns is recorded into the graph, but what it does (collect features for a perceptual
loss, log, count) happens then and never again, and a backward hook is lost. A module with
hooks is therefore kept opaque: its ``__call__``, hooks included, runs inside its stage on
each micro-batch (and again when a checkpointed stage recomputes, as with torchgpipe).
Standard torch.nn layers are kept too: torch.fx calls them anyway, but torch.export would go
into an ``nn.Embedding`` and run its hook once (transformers' ``gradient_checkpointing_enable``
hooks the input embeddings). Under torch.export a kept module is traced and then collapsed
into one node, so its hooks also run once while capturing, on fake tensors. The model's own
(root) hooks cannot be kept: the pipeline calls the stages, never the model, so they are
refused; the pipeline is a module, and hooks registered on it run around each call.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Callable, Dict, List, Sequence, Tuple

from torch.utils.hooks import RemovableHandle

from torch import nn

from ..errors import TraceError

__all__ = ["FXPIPE_GUARD", "HOOK_DICTS", "NewHooks", "has_hooks", "hooked_modules", "holds_live_hook",
           "live_hook_kinds", "records_now"]

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _records_while_tracing(hook: Any) -> bool:
    """transformers' output-capturing hook (``output_hidden_states=True``, ``output_attentions``).

    transformers (5.x) registers it on the decoder layers lazily, at a model's first call that
    asks for those outputs, so the same model has it at one build and not at the one before.
    It does nothing unless transformers' collector is active, which happens only inside the
    model's own decorated forward: while capturing, where what it appends becomes graph outputs,
    never inside a stage. Tracing through it is exact; keeping the layer opaque for it would
    only change the graph from one build to the next (and the plan with it).
    """
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing" and \
        getattr(hook, "__name__", None) == "output_capturing_hook"


def records_now(module: nn.Module) -> bool:
    """Whether one of transformers' output-capturing hooks on ``module`` would record if it ran
    now: the collector is active (inside the model's forward) and asks for what it records.

    Tracing through such a hook is exact; a module kept whole while torch.fx traces never runs
    it, so what it records (``hidden_states``, ``attentions``) would be missing from the graph's
    output, and in the stages, where no collector is active, it records nothing either.
    """
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    if not collected:
        return False
    for hook in module._forward_hooks.values():
        if _records_while_tracing(hook):
            key = inspect.getclosurevars(hook).nonlocals.get("key")
            if key is None or key in collected:
                return True
    return False


#: set on a hook of fxpipe's own that only guards eager calls (``fxpipe.distributed``'s refusal
#: of a model whose weights a rank released): nothing a stage should run, so not a user's hook
FXPIPE_GUARD = "_fxpipe_guard"


def holds_live_hook(hooks: Dict[Any, Any]) -> bool:
    """Whether one of a module's hook dicts holds a hook that tracing would lose."""
    return any(not _records_while_tracing(h) and not getattr(h, FXPIPE_GUARD, False)
               for h in hooks.values()) if hooks else False


def has_hooks(module: nn.Module) -> bool:
    return any(holds_live_hook(getattr(module, name, None) or {}) for name in HOOK_DICTS)


def live_hook_kinds(module: nn.Module) -> List[str]:
    """The kinds of hook ``module`` holds live, as a message names them ('forward pre hooks')."""
    return [name.strip("_").replace("_", " ") for name in HOOK_DICTS
            if holds_live_hook(module.__dict__.get(name) or {})]


def hooked_modules(model: nn.Module, already_opaque: Callable[[nn.Module], bool],
                   quiet: Callable[[nn.Module], bool]) -> List[str]:
    """Qualified names of the submodules to keep opaque for their hooks, on either capture;
    :class:`TraceError` when the model itself has hooks.

    ``already_opaque``: modules kept whole whatever the capture (``leaf_modules``). A warning
    names each module except those ``quiet`` allows: a torch.nn layer, whose hooks a user
    expects to run on each call, as they do (torch.fx never goes into one)."""
    if has_hooks(model):
        raise TraceError(
            f"{type(model).__name__} itself has forward or backward hooks: a pipeline runs its stages, never "
            "the model's own __call__, so they would not run. What to do: register them on the pipeline "
            "(pipe = fxpipe.pipeline(...); pipe.register_forward_hook(...)), or on a submodule.",
            reason="hooks on the root module")
    names = [name for name, m in model.named_modules() if name and has_hooks(m) and not already_opaque(m)]
    outermost = [n for n in names if not any(n.startswith(p + ".") for p in names)]
    for name in outermost:
        if quiet(model.get_submodule(name)):
            continue
        warnings.warn(f"fxpipe: {name!r} ({type(model.get_submodule(name)).__name__}) has hooks: kept opaque, so "
                      "they run on each of its calls, not only once while tracing: once per micro-batch, "
                      "seeing that micro-batch (not the whole batch), and again when a checkpointed stage "
                      "recomputes (fxpipe.runtime._checkpoint.is_recomputing() tells the two "
                      "apart)", stacklevel=3)
    return outermost


class NewHooks:
    """Hooks registered, after the build, on modules the stages call (kept opaque: a torch.nn
    layer, a leaf) or inside them. Such a hook runs in the stages once per micro-batch, and the
    build's check never saw it: a forward hook mixing the batch (``o - o.mean(0)``) registered
    on an ``nn.Linear`` after the build trained 1.1e-2 off, silently (a trial); the same hook
    before the build is refused. Hooks removed since are fine.

    Per call this costs one integer compare (torch numbers every hook handle from one counter)
    unless some hook was registered anywhere since the last call; then the modules' hook dicts
    are compared with those at the build."""

    def __init__(self, modules: Sequence[Tuple[nn.Module, str]]) -> None:
        self._modules = list(modules)
        self._compile()

    def _compile(self) -> None:
        self._dicts = [(sub.__dict__[h], f"{label}.{name}".strip("."), h) for m, label in self._modules
                       for name, sub in m.named_modules() for h in HOOK_DICTS]
        self._keys = [set(d) for d, _, _ in self._dicts]
        self._seen = RemovableHandle.next_id

    def __getstate__(self) -> dict:
        return {"_modules": self._modules}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._compile()

    def unchanged(self) -> bool:
        if RemovableHandle.next_id == self._seen:
            return True
        if self.added():
            return False
        self._seen = RemovableHandle.next_id
        return True

    def added(self) -> List[str]:
        """Each hook registered since the build, as a message line."""
        out = []
        for (hooks, label, kind), keys in zip(self._dicts, self._keys):
            if any(k not in keys and not getattr(h, FXPIPE_GUARD, False) for k, h in hooks.items()):
                out.append(f"a {kind.strip('_').replace('_', ' ')[:-1]} was registered on '{label}' after the build: "
                           "it runs in the stages once per micro-batch, and the build did not check it (a hook that "
                           "computes across the batch would silently differ per micro-batch); build the pipeline "
                           "again after registering it")
        return out
