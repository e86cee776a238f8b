"""torch.fx's trace of a model's flat root, with fxpipe's leaf policy, retried module by module.

:func:`trace_fx` traces; a module whose code torch.fx cannot trace (a branch on a tensor, a
random draw or a context read baked at trace time: :mod:`._trace_time`, :mod:`._call_context`)
is kept opaque and the trace retried, up to :data:`MAX_RETRIES` times; a failure in the root's
own forward ends it (the capture then tries torch.export, :mod:`._tracing`). The tracer names
each node's module and user source line, records grad-mode/autocast regions and custom autograd
Functions as nodes, and ``h += x`` in place.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from ._attr_reads import AttrRead, AttributeReads
from ._augmented import AugmentedProxy
from ._call_context import ContextReads
from ._custom_functions import applying_as_nodes
from ._export import _Failure
from ._grad_regions import REGION, RegionRecorder
from ._hooks import records_now
from ._trace_time import (DrewAtTrace, DrewFromPython, KeepsState, TensorsComputedOn, TensorsReadAsNumbers, baked_at_trace,
                          drew_since, python_drew_since, python_states)
from ._user_code import user_stack
from ..errors import TraceError
from ..runtime._randomness import generator_states

__all__ = ["trace_fx", "is_standard_layer", "MAX_RETRIES"]

#: modules made opaque automatically before a trace gives up
MAX_RETRIES = 24

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def is_standard_layer(m: nn.Module) -> bool:
    mod = type(m).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(m, _CONTAINERS)


class _Tracer(fx.Tracer):
    """fx tracer with fxpipe's leaf policy and module-path bookkeeping."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: set[str]) -> None:
        super().__init__()
        # Stack traces are recorded by create_node below (user frames only), not by fx: fx
        # symbolises every frame of every node's stack through linecache (most of a big
        # model's trace time: 15 frames a node) and then keeps the few in user files.
        self.record_stack_traces = False
        self.leaf_types, self.leaf_names = leaf_types, leaf_names
        self.stack: list[str] = [""]
        self.failure_stack: list[str] | None = None
        self.opaque: list[str] = []  # non-standard leaves actually used
        self.lost_records: list[str] = []  # leaves whose transformers output hook would record (capture._hooks)
        self.regions = RegionRecorder()  # grad-mode / autocast `with` blocks (fxpipe.capture._grad_regions)

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        # custom autograd.Functions kept whole, one node each (fxpipe.capture._custom_functions)
        with self.regions, applying_as_nodes(self):
            return super().trace(root, concrete_args)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_names or isinstance(m, self.leaf_types):
            if qualname not in self.opaque:
                self.opaque.append(qualname)
            return True
        return is_standard_layer(m)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        path = self.path_of_module(m)
        if m._forward_hooks and self.is_leaf_module(m, path) and records_now(m) and path not in self.lost_records:
            self.lost_records.append(path)
        self.stack.append(path)
        before = None if self.is_leaf_module(m, path) else generator_states()
        python = None if before is None else python_states()
        buffers = dict(m._buffers)
        try:
            out = super().call_module(m, forward, args, kwargs)
            if _assigned_traced(m, buffers):
                raise TraceError(f"module '{path}' assigns a traced value to a buffer (self.n += x.shape[0]): "
                                 "torch.fx would replace the buffer with it", module=path,
                                 reason="a buffer assigned a traced value")
            if python is not None and python_drew_since(python):
                raise DrewFromPython(path)  # refused, not retried: see fxpipe.capture._trace_time
            if before is not None and drew_since(before):
                raise DrewAtTrace(path)  # innermost first: its callers see the exception, not a draw
            return out
        except Exception:
            if self.failure_stack is None:  # innermost frame records first
                self.failure_stack = list(self.stack)
            raise
        finally:
            self.stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        region = self.regions.region()  # raises RegionError where a mode changed untraceably
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:
            node.stack_trace = user_stack() or None
        node.meta["fxpipe_module"] = self.stack[-1]
        if region is not None:
            node.meta[REGION] = region
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        # `h += x` recorded in place, as eager runs it (see fxpipe.capture._augmented)
        return AugmentedProxy(node, self)


def _assigned_traced(m: nn.Module, buffers: dict) -> bool:
    """Whether ``m``'s forward assigned a traced value to one of its buffers (``self.n +=
    x.shape[0]``: the in-place add of a proxy, then the assignment); each is put back. Kept
    opaque, the module updates the buffer itself, once per micro-batch."""
    replaced = [name for name, b in m._buffers.items() if isinstance(b, fx.Proxy)]
    for name in replaced:
        m._buffers[name] = buffers.get(name)
    return bool(replaced)


def trace_fx(model: nn.Module, root: nn.Module, leaf_types: tuple[type, ...],
              leaf_names: set[str]
              ) -> tuple[fx.Graph, list[str], list[_Failure], list[AttrRead], list[str]] | _Failure:
    auto: list[_Failure] = []
    for _ in range(MAX_RETRIES):
        tracer = _Tracer(leaf_types, leaf_names | {f.module for f in auto})
        try:
            before, python, root_buffers = generator_states(), python_states(), dict(root._buffers)
            with AttributeReads(model) as reads, \
                    TensorsReadAsNumbers(model, lambda: tracer.stack[-1]) as numbers, \
                    TensorsComputedOn(model, lambda: tracer.stack[-1]) as computed, \
                    ContextReads(getters=False, module=lambda: tracer.stack[-1]) as context:  # fx runs no leaf: the traced code's
                graph = tracer.trace(root)
            if _assigned_traced(root, root_buffers):  # in the root's own forward: torch.export's to capture
                raise TraceError("the root forward assigns a traced value to a buffer", module="",
                                 reason="a buffer assigned a traced value")
            if python_drew_since(python):  # in the root's own forward
                raise DrewFromPython("")
            baked = baked_at_trace(before, numbers, computed, reads, context,
                                   lambda m: m in tracer.leaf_names or any(f.module == m for f in auto))
            if baked is not None:
                tracer.failure_stack = [baked[1]]
                raise baked[0]
            return graph, tracer.opaque, auto, reads.reads(), tracer.lost_records
        except (DrewFromPython, KeepsState):
            raise  # no capture can hold it (torch.export bakes it too, or loses the state): refused as it is
        except Exception as e:  # noqa: BLE001 - any failure is a reason to fall back
            stack = [s for s in (tracer.failure_stack or [""]) if s and s not in tracer.leaf_names]
            if not stack:
                return _Failure("", e, [f.module for f in auto])
            auto.append(_Failure(stack[-1], e))
    return _Failure(auto[-1].module, auto[-1].error, [f.module for f in auto[:-1]])
