"""Grad-mode and autocast regions inside a traced forward, recorded and re-established.

torch.fx records *what* a forward computes, not the mode it computes it in: under
``with torch.no_grad():`` (or ``enable_grad``, ``set_grad_enabled(b)``, ``inference_mode``,
``torch.autocast(..., enabled=False / dtype=...)``, or a helper decorated with one of them)
the traced nodes look like any other, so a pipeline would give ``a.weight`` a gradient that
eager leaves ``None``, or compute in bfloat16 what eager computes in float32.

Recording (:class:`RegionRecorder`, used by the fx tracer): while tracing, the
``__enter__``/``__exit__`` of those context managers are observed, so fxpipe knows which
settings the forward itself set -- not merely which differ from the tracing thread's, which
would miss ``enable_grad`` traced with grad on, or ``autocast(enabled=False)`` traced
without an outer autocast (the rotary-embedding case). Each node created under such a
``with`` gets ``node.meta[REGION]``: the *absolute* values of exactly those settings (the
settings it did not set follow the caller, as in eager). A setting changed any other way
(``torch.set_grad_enabled(False)`` as a statement, ``torch._C._set_grad_enabled``) cannot be
followed: tracing of that module fails with :class:`RegionError`, and the capture keeps the
module opaque (it then runs its own forward eagerly) or says what to do.

Re-establishing (:func:`apply_regions`, used by emission): every region node of a stage
calls its target through a wrapper that enters the region around that one call. The
region therefore travels with each node: it survives any cut through the middle of a
``with`` block, checkpoint recomputation and worker threads, and an exception cannot leave
the mode switched.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.fx.graph import _format_target

from ..errors import TraceError
from ._node_kinds import COMPUTE_OPS

__all__ = ["REGION", "Region", "RegionError", "RegionGraphModule", "RegionInterpreter", "RegionRecorder", "entered",
           "inference_values", "recompile_in_regions", "region_name"]

#: ``node.meta`` key: the node's :data:`Region`, only on nodes created inside one.
REGION = "fxpipe_region"

#: ``(setting, value)`` pairs in the order they are entered: ``("inference", bool)``,
#: ``("grad", bool)``, ``("autocast", (device_type, enabled, dtype))``, ``("autocast_cache", bool)``.
Region = Tuple[Tuple[str, Any], ...]



class RegionError(TraceError):
    """The forward changed grad mode or autocast other than with a ``with`` block fxpipe follows."""


# -- recording -----------------------------------------------------------------------------
def _autocast_devices() -> Tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _value(key: Any) -> Any:
    """The thread's current value of one setting."""
    if key == "inference":
        return torch.is_inference_mode_enabled()
    if key == "grad":
        return torch.is_grad_enabled()
    if key == "autocast_cache":
        return torch.is_autocast_cache_enabled()
    device = key[1]
    return device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def _order(key: Any) -> Tuple[int, str]:
    # inference mode first (entering it switches grad mode too), then grad, then autocast
    rank = {"inference": 0, "grad": 1, "autocast_cache": 3}
    return (rank[key], "") if isinstance(key, str) else (2, key[1])


def _keys(manager: Any) -> Tuple[Any, ...]:
    """The settings a context manager sets."""
    if isinstance(manager, torch.autograd.grad_mode.inference_mode):
        return ("inference", "grad")
    if isinstance(manager, torch.amp.autocast_mode.autocast):
        return (("autocast", manager.device), "autocast_cache")
    return ("grad",)


_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_originals: Dict[Tuple[type, str], Callable[..., Any]] = {}


def _managers() -> List[type]:
    g = torch.autograd.grad_mode
    return [g.no_grad, g.enable_grad, g.set_grad_enabled, g.inference_mode, torch.amp.autocast_mode.autocast]


def _observing_enter(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __enter__(self: Any) -> Any:
        out = orig(self)
        recorder = getattr(_local, "recorder", None)
        if recorder is not None:
            recorder.frames.append((id(self), _keys(self)))
        return out
    return __enter__


def _observing_exit(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __exit__(self: Any, *exc: Any) -> Any:
        recorder = getattr(_local, "recorder", None)
        if recorder is not None:
            for i in range(len(recorder.frames) - 1, -1, -1):
                if recorder.frames[i][0] == id(self):
                    del recorder.frames[i]
                    break
        return orig(self, *exc)
    return __exit__


def _install() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        for cls in _managers():
            for name, wrap in (("__enter__", _observing_enter), ("__exit__", _observing_exit)):
                _originals[(cls, name)] = cls.__dict__[name]
                setattr(cls, name, wrap(cls.__dict__[name]))


def _uninstall() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users:
            return
        for (cls, name), orig in _originals.items():
            setattr(cls, name, orig)
        _originals.clear()


class RegionRecorder:
    """Observes, on this thread, the grad-mode/autocast ``with`` blocks a trace runs through.

    Use as a context around one trace; :meth:`region` gives the region for a node created
    now, or None outside every block. The context managers' classes are patched only while
    some recorder is active, and the patches record only on the recording thread.
    """

    def __init__(self) -> None:
        self.frames: List[Tuple[int, Tuple[Any, ...]]] = []
        self.baseline: Dict[Any, Any] = {}

    def _watched(self) -> List[Any]:
        return ["inference", "grad", "autocast_cache", *(("autocast", d) for d in _autocast_devices())]

    def __enter__(self) -> "RegionRecorder":
        self.frames = []
        self.baseline = {k: _value(k) for k in self._watched()}
        self._outer = getattr(_local, "recorder", None)
        _install()
        _local.recorder = self
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        _local.recorder = self._outer
        _uninstall()
        changed = self._changed(set())
        if changed:
            self._restore()
            if exc_type is None:
                raise RegionError(
                    f"the forward leaves {', '.join(changed)} changed after it returns (e.g. "
                    "torch.set_grad_enabled(False) as a statement): eager changes the caller's mode "
                    "that way, which a pipeline cannot reproduce. What to do: use a `with` block "
                    "(with torch.no_grad(): ...) inside the forward.", reason="grad mode set outside a with block")

    def _changed(self, explicit: set) -> List[str]:
        return [_label(k) for k in self._watched() if k not in explicit and _value(k) != self.baseline[k]]

    def _restore(self) -> None:
        torch._C._set_grad_enabled(self.baseline["grad"])
        torch.set_autocast_cache_enabled(self.baseline["autocast_cache"])
        for d in _autocast_devices():
            _, enabled, dtype = self.baseline[("autocast", d)]
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)

    def region(self) -> Optional[Region]:
        """The node-to-be-created's region: the current values of the settings the open
        ``with`` blocks set. Raises :class:`RegionError` when another setting changed."""
        explicit = {k for _, keys in self.frames for k in keys}
        changed = self._changed(explicit)
        if changed:
            raise RegionError(
                f"{', '.join(changed)} changed inside the forward other than by a `with` block "
                "(torch.no_grad / enable_grad / set_grad_enabled / inference_mode / torch.autocast) "
                "that fxpipe can follow, e.g. torch.set_grad_enabled(False) as a statement. What to do: "
                "use a `with` block, or keep the module opaque with leaf_modules=[...].",
                reason="grad mode or autocast set outside a with block")
        if not explicit:
            return None
        return tuple((k if isinstance(k, str) else "autocast", _value(k)) for k in sorted(explicit, key=_order))


def _label(key: Any) -> str:
    return {"inference": "inference mode", "grad": "grad mode", "autocast_cache": "the autocast cache"}.get(
        key, f"autocast on {key[1] if isinstance(key, tuple) else key}")


def inference_values(graph: fx.Graph) -> List[Tuple[fx.Node, List[fx.Node]]]:
    """Each node computed in inference mode, with the compute nodes that use its result.

    That result is an inference tensor, which a stage boundary or portal cannot carry
    (checkpointing and the runtime's autograd functions save what crosses for backward:
    "Inference tensors cannot be saved for backward"); the capture keeps each pair in one
    stage, where it runs as in eager (see ``fxpipe.capture._tracing``).
    """
    found = []
    for node in graph.nodes:
        if node.op in COMPUTE_OPS and dict(node.meta.get(REGION) or ()).get("inference"):
            users = [u for u in node.users if u.op in COMPUTE_OPS]
            if users:
                found.append((node, users))
    return found


# -- re-establishing -----------------------------------------------------------------------
def entered(region: Region) -> ExitStack:
    """A context that sets exactly ``region``'s settings (the others are left as they are)."""
    stack = ExitStack()
    cache = dict(region).get("autocast_cache", torch.is_autocast_cache_enabled())
    for key, value in region:
        if key == "inference":
            stack.enter_context(torch.inference_mode(value))
        elif key == "grad":
            stack.enter_context(torch.set_grad_enabled(value))
        elif key == "autocast":
            device, enabled, dtype = value
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack


def region_name(region: Region) -> str:
    """A short identifier for ``region``: ``no_grad``, ``autocast_cpu_off``, ``inference_mode``."""
    parts: List[str] = []
    settings = dict(region)
    if "inference" in settings:
        parts.append("inference_mode" if settings["inference"] else "no_inference_mode")
    elif "grad" in settings:
        parts.append("enable_grad" if settings["grad"] else "no_grad")
    for key, value in region:
        if key == "autocast":
            device, enabled, dtype = value
            parts.append(f"autocast_{device}_{str(dtype).replace('torch.', '') if enabled else 'off'}")
    return "_".join(parts) or "region"


_functions: Dict[Tuple[Region, Any, str], Callable[..., Any]] = {}
_functions_lock = threading.Lock()


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = "fxpipe"
    return fn


def _function_in(region: Region, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` called inside ``region`` (one wrapper per pair, so stage code stays stable)."""
    key = (region, target, "function")
    with _functions_lock:
        if key not in _functions:
            def call(*args: Any, **kwargs: Any) -> Any:
                with entered(region):
                    return target(*args, **kwargs)
            base = getattr(target, "__name__", "call").strip("_") or "call"
            _functions[key] = _named(call, f"{region_name(region)}__{base}")
        return _functions[key]


def _method_in(region: Region, method: str) -> Callable[..., Any]:
    """``self_.method(...)`` called inside ``region``."""
    key = (region, method, "method")
    with _functions_lock:
        if key not in _functions:
            def call(self_: Any, *args: Any, **kwargs: Any) -> Any:
                with entered(region):
                    return getattr(self_, method)(*args, **kwargs)
            _functions[key] = _named(call, f"{region_name(region)}__{method.strip('_') or 'call'}")
        return _functions[key]


def _module_in(region: Region) -> Callable[..., Any]:
    """``module(...)`` called inside ``region`` (the module comes first)."""
    key = (region, None, "module")
    with _functions_lock:
        if key not in _functions:
            def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                with entered(region):
                    return module(*args, **kwargs)
            _functions[key] = _named(call, f"{region_name(region)}__call")
        return _functions[key]


class _Submodule:
    """An argument that fx code generation writes as ``self.<path>`` (the module itself)."""

    def __init__(self, target: str) -> None:
        self.code = _format_target("self", target)

    def __repr__(self) -> str:
        return self.code


def _code_graph(graph: fx.Graph) -> Optional[fx.Graph]:
    """A copy of ``graph`` whose region nodes call their targets through wrappers entering
    the region, for code generation only; None when ``graph`` has no region node.

    The copy has the same nodes in the same order (so a generated line still maps to its
    node), while ``graph`` itself keeps its ``call_module`` nodes and targets for every pass
    that reads them (profiling, placement, planning).
    """
    if not any(n.meta.get(REGION) and n.op in COMPUTE_OPS for n in graph.nodes):
        return None
    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    copy._codegen = graph._codegen
    env: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        new = copy.node_copy(node, env.__getitem__)
        env[node] = new
        region = node.meta.get(REGION)
        if not region or node.op not in COMPUTE_OPS:
            continue
        if node.op == "call_function":
            new.target = _function_in(region, node.target)
        elif node.op == "call_method":
            new.op, new.target = "call_function", _method_in(region, node.target)
        else:
            new.op, new.target = "call_function", _module_in(region)
            new.args = (_Submodule(str(node.target)), *new.args)
    return copy


def recompile_in_regions(gm: fx.GraphModule, recompile: Callable[[], Any]) -> Any:
    """Run ``recompile`` (a GraphModule's own) so that the code it generates enters each
    node's region; ``gm.graph`` is left as it is. The code (``gm.code``, the stage code
    fxpipe prints) then shows the wrappers, e.g. ``a = fxpipe_no_grad__call(self.a, x)``."""
    runnable = _code_graph(gm.graph)
    if runnable is None:
        return recompile()
    pristine = gm.__dict__["_graph"]
    gm.__dict__["_graph"] = runnable
    try:
        return recompile()
    finally:
        gm.__dict__["_graph"] = pristine


class RegionGraphModule(fx.GraphModule):
    """The captured GraphModule: running it (every sample run of the build) enters the
    regions its nodes were traced in, as the emitted stages do."""

    def recompile(self) -> Any:
        return recompile_in_regions(self, super().recompile)


class RegionInterpreter(fx.Interpreter):
    """An fx Interpreter that runs each node in the region it was traced in, as the graph's
    code does (:class:`RegionGraphModule`): a pass that runs the graph node by node (the
    profile, the check's recorded micro-batch) computes what the graph's own call computes."""

    def run_node(self, n: fx.Node) -> Any:
        region = n.meta.get(REGION) if n.op in COMPUTE_OPS else None
        if not region:
            return super().run_node(n)
        with entered(region):
            return super().run_node(n)
