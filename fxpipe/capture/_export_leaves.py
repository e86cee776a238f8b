"""``leaf_modules`` on the torch.export path: each call of a kept-opaque module becomes one node.

torch.fx keeps a leaf as a ``call_module`` node because its tracer asks, module by module,
whether to go in. torch.export has no such question: it traces every module down to aten
ops. But it can be asked to record how each call of a module was made
(``preserve_module_call_signature``): which graph values went in (as the pytree of the
call's ``(args, kwargs)``) and which came out. With that, the aten nodes of the call (the
nodes whose ``nn_module_stack`` holds that call) are replaced by one
``call_module`` node fed the same arguments, and the values other nodes read from the
region by the call's outputs. The user's block then runs eagerly inside one stage,
whichever capture was used, exactly as with fx.

A region the rest of the graph reads other than through the call's outputs, or whose
buffer updates land outside the module, cannot be collapsed honestly: it is refused
(:class:`~fxpipe.errors.TraceError`) naming the module.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

from torch import fx, nn
from torch.export.graph_signature import ConstantArgument
from torch.utils import _pytree as pytree

from ..errors import TraceError

__all__ = ["leaf_paths", "collapse_leaf_calls", "output_leaf"]


def leaf_paths(model: nn.Module, leaf_modules: Iterable[type | str]) -> list[str]:
    """Qualified names of the modules to keep opaque (outermost only: a leaf inside a leaf is moot)."""
    wanted = list(leaf_modules)
    types = tuple(x for x in wanted if isinstance(x, type))
    names = {x for x in wanted if isinstance(x, str)}
    found = [name for name, m in model.named_modules() if name and (name in names or (types and isinstance(m, types)))]
    return [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]


def output_leaf(value: Any, index: int) -> Any:
    """Leaf ``index`` of a module call's output, flattened as torch.export flattened it."""
    return pytree.tree_leaves(value)[index]


def _call_key(stack_key: str, path: str) -> str:
    """``'blk'`` for the first call of module ``blk``, ``'blk@1'`` for its second (export's naming)."""
    _, at, n = stack_key.rpartition("@")
    return f"{path}@{n}" if at and n.isdigit() else path


def collapse_leaf_calls(graph: fx.Graph, calls: Sequence[Any], leaves: Sequence[str], clean_path: Any,
                        by_name: dict[str, fx.Node]) -> list[str]:
    """Replace each recorded call of a leaf module in ``graph`` by one ``call_module`` node.

    ``calls``: ``ep.module_call_graph``; ``by_name``: the export graph's node names -> nodes
    of ``graph``; ``clean_path`` turns an ``nn_module_stack`` path into a qualified name.
    Returns the leaves actually called. Raises :class:`TraceError` when a call cannot be
    collapsed exactly.
    """
    entries = {e.fqn: e.signature for e in calls if e.signature is not None}
    region: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            path = clean_path(value[0] if isinstance(value, tuple) else str(value))
            if path in leaves:
                region.setdefault(_call_key(key, path), []).append(node)
                break
    used: list[str] = []
    for call, nodes in region.items():
        leaf = call.partition("@")[0]
        sig = entries.get(call)
        if sig is None:
            raise _refusal(leaf, "torch.export recorded no signature for this call")
        _collapse(graph, leaf, sig, nodes, by_name)
        if leaf not in used:
            used.append(leaf)
    return used


def _collapse(graph: fx.Graph, leaf: str, sig: Any, nodes: list[fx.Node], by_name: dict[str, fx.Node]) -> None:
    inside = set(nodes)

    def value(arg: Any) -> Any:
        if isinstance(arg, ConstantArgument):
            return arg.value
        name = getattr(arg, "name", "")
        if name not in by_name:
            raise _refusal(leaf, f"its input {name!r} is not a value of the graph")
        node = by_name[name]
        if node in inside:
            raise _refusal(leaf, f"its input {name!r} is computed inside the call")
        return node

    inputs = [value(a) for a in sig.inputs]
    try:
        args, kwargs = pytree.tree_unflatten(inputs, sig.in_spec)
    except ValueError:  # torch.export recorded no inputs: a call inside a region it wraps (torch.no_grad())
        raise _refusal(leaf, f"torch.export recorded {len(inputs)} of its arguments (a call inside a region export "
                       "wraps as one operation, such as torch.no_grad())") from None
    outputs = [None if isinstance(a, ConstantArgument) else by_name.get(a.name) for a in sig.outputs]
    # Buffer updates of the call: the module makes them itself when it runs eagerly.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.meta.get("fxpipe_buffer_update") and node.args[1] in inside:
            target = node.args[0].target
            if not str(target).startswith(leaf + "."):
                raise _refusal(leaf, f"it updates '{target}', a buffer of another module")
            inside.add(node)
    readers = [(n, u) for n in inside for u in n.users if u not in inside and n not in outputs]
    if readers:
        n, u = readers[0]
        raise _refusal(leaf, f"{u.name!r} reads {n.name!r}, a value inside the call that it does not return")
    first = next(n for n in graph.nodes if n in inside)
    with graph.inserting_before(first):
        call = graph.call_module(leaf, tuple(args), dict(kwargs))
        call.meta.update({k: v for k, v in first.meta.items() if k in ("stack_trace", "nn_module_stack")})
        call.meta["fxpipe_module"] = leaf
        tuple_out = sig.out_spec.type in (tuple, list) and all(c.is_leaf() for c in sig.out_spec.children())
        for i, old in enumerate(outputs):
            if old is None or old not in inside:
                continue  # a constant, or an input returned as is
            if sig.out_spec.is_leaf():
                new = call
            elif tuple_out:
                new = graph.call_function(operator.getitem, (call, i))
            else:
                new = graph.call_function(output_leaf, (call, i))
            if new is not call:
                new.meta.update({k: v for k, v in old.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
                new.meta["fxpipe_module"] = leaf  # it reads the call: not a module inside the leaf
            old.replace_all_uses_with(new)
            by_name.update({name: new for name, n in by_name.items() if n is old})  # later calls read it
    for node in reversed([n for n in graph.nodes if n in inside]):
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)


def _refusal(leaf: str, why: str) -> TraceError:
    reason = f"the call of '{leaf}' cannot be kept as one node under torch.export: {why}"
    return TraceError(f"fxpipe cannot keep '{leaf}' opaque (it is in leaf_modules, or it has hooks, which run on "
                      f"each of its calls only while it is kept whole): {reason}.\n"
                      f"What to do: keep a module that encloses it opaque instead (leaf_modules=[...]); or drop "
                      f"'{leaf}' from leaf_modules, or move its hooks to an enclosing module, so that it is traced "
                      "through and split like the rest.", module=leaf, reason=reason)
