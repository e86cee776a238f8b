"""Higher-order ops in torch.export graphs: the regions they wrap, kept and checked.

torch.export captures a ``torch.no_grad()`` / ``torch.set_grad_enabled(...)`` region, and a
``torch.autocast(...)`` region, as one call of a higher-order op (``wrap_with_set_grad_enabled``,
``wrap_with_autocast``) whose body is a ``submod_N`` GraphModule reached by ``get_attr``.
Every rotary-embedding decoder in transformers (Llama, Mistral, Qwen2, Phi, GPT-NeoX,
Gemma) computes its cos/sin table in such a region.

Why keep the call rather than inline the body: the call *is* the region's semantics (grad
off, autocast off). Inlined, the cos/sin table would carry gradients eager does not have,
and an autocast-disabled region would run in bfloat16 under the caller's autocast. Kept,
the stage that calls it holds the body (an emitted stage copies every ``get_attr`` target
it uses, modules included), the profiler times the call like any ``call_function``, and
the stage code reads ``wrap_with_set_grad_enabled(False, self.submod_1, ...)``.

Both ops run eagerly by calling their body under the context they stand for. Any other
higher-order op (``cond``, ``map``, ``while_loop``, ``flex_attention``, effect tokens, ...)
is refused at capture with a message naming it, the module and the source line.
"""

from __future__ import annotations

from typing import Any, Iterator

import re

import torch
from torch import fx, nn

from ..errors import TraceError
from ._user_code import source_location

__all__ = ["SUPPORTED_HOPS", "hop_name", "hop_error", "unsupported_hop", "keep_body", "subgraphs"]

#: higher-order ops whose call fxpipe keeps in stage code (name -> what the region means)
SUPPORTED_HOPS = {
    "wrap_with_set_grad_enabled": "a torch.no_grad() / torch.set_grad_enabled() region",
    "wrap_with_autocast": "a torch.autocast() region",
}


def hop_name(target: Any) -> str | None:
    """The name of a higher-order op call target (``'cond'``), None for any other target."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return None


def subgraphs(gm: nn.Module) -> Iterator[tuple[fx.Node, fx.GraphModule]]:
    """``(get_attr node, body)`` for every GraphModule a graph reaches by get_attr, nested ones too."""
    if not isinstance(gm, fx.GraphModule):
        return
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            body = _fetch(gm, node.target)
            if isinstance(body, fx.GraphModule):
                yield node, body
                yield from subgraphs(body)


def unsupported_hop(graph: fx.Graph, bodies: dict[str, fx.GraphModule]) -> fx.Node | None:
    """The first call of a higher-order op fxpipe does not run, or None.

    Looks at ``graph`` and at every body it reaches by get_attr (``bodies``), nested ones too.
    """
    reached = [bodies[n.target] for n in graph.nodes if n.op == "get_attr" and n.target in bodies]
    for g in [graph, *(b.graph for body in reached for b in [body, *(s for _, s in subgraphs(body))])]:
        for node in g.nodes:
            name = hop_name(node.target) if node.op == "call_function" else None
            if name is not None and name not in SUPPORTED_HOPS:
                return node
    return None


def keep_body(body: fx.GraphModule) -> fx.GraphModule:
    """``body`` made fit for a stage: the sample's dtype/device assertions removed, recursively.

    Export pins each intermediate's dtype and device in ``_assert_tensor_metadata`` calls;
    a stage may run on another device, and under autocast on other dtypes. The top-level
    graph drops them the same way (:func:`fxpipe.capture._export.export_graph`).
    """
    for graph_module in [body, *(sub for _, sub in subgraphs(body))]:
        for node in list(graph_module.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
                graph_module.graph.erase_node(node)
        graph_module.recompile()
    return body


def hop_error(model_name: str, node: fx.Node, module: str) -> TraceError:
    """The refusal of a higher-order op fxpipe does not run, naming it, its module and its line."""
    name = hop_name(node.target)
    where = _user_location(node) or "unknown"
    reason = (f"torch.export captured a call of the higher-order op torch.ops.higher_order.{name}, which "
              f"fxpipe does not run in pipeline stages (it runs {' and '.join(SUPPORTED_HOPS)})")
    if module:
        todo = (f"pass leaf_modules=['{module}'] to keep that module opaque (one node, run eagerly inside "
                "one stage)")
    else:
        todo = ("the op is called in the root forward, which cannot be opaque: move it into a submodule "
                "and pass leaf_modules=['<that submodule>']")
    return TraceError(
        f"fxpipe cannot pipeline {model_name}: {reason}.\n"
        f"  module:   {repr(module) if module else 'the root module'}\n"
        f"  location: {where}\n"
        f"What to do: {todo}.", module=module, location=where, reason=reason)


def _user_location(node: fx.Node) -> str | None:
    """The node's innermost user source line, skipping generated code (``<eval_with_key>``)."""
    trace = str(node.meta.get("stack_trace") or "")
    blocks = re.split(r'(?m)^(?=\s*File ")', trace)
    probe = fx.Graph().placeholder("x")
    probe.meta["stack_trace"] = "".join(b for b in blocks if not re.match(r'\s*File "<', b))
    return source_location(probe)


def _fetch(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
