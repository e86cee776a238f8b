"""Containers the model returns whole from an fx graph, opened into their leaves.

torch.fx sees the result of an opaque leaf module (or of ``x.split(...)``) as one value: a
model that returns it gives the graph an output *leaf* that is really a dataclass, a
``ModelOutput``, a dict or a tuple of tensors. Micro-batch outputs are merged leaf by leaf
(:class:`fxpipe.checks._batching.Batching`), and a whole container cannot be concatenated. So each
such output is opened in the graph itself: its leaves (by :func:`fxpipe.tree.flatten`, as
the pipeline's output is rebuilt) become outputs of their own, and the output spec rebuilds
the container around them. torch.export graphs return leaves already.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ._tracing import Capture
from ._export_outputs import compose_out_spec
from ..tree import flatten

__all__ = ["open_output_containers", "output_leaf"]


def output_leaf(value: Any, k: int) -> Any:
    """Leaf ``k`` of ``value``, in :func:`fxpipe.tree.flatten` order.

    One graph node per leaf, each reading the container: what crosses a stage boundary is
    the container or a leaf, never a list of leaves with its spec.
    """
    return flatten(value)[0][k]


def open_output_containers(captured: Capture, flat_inputs: Sequence[Any], values: Any = None) -> None:
    """Rewrites ``captured`` (graph and ``out_spec``) so that no output leaf is a container.

    Looks at the graph's outputs on the sample: ``values`` when the caller has them (the
    mutation watcher's run), else runs the graph once: wrap the call in
    :func:`fxpipe.capture._prepare.preserved`.
    """
    if captured.method != "fx":
        return
    gm = captured.graph_module
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)) or not any(isinstance(n, fx.Node) and n.op != "placeholder" for n in outs):
        return
    if values is None:
        with torch.no_grad():
            values = gm(*flat_inputs)
    specs: List[Optional[pytree.TreeSpec]] = []
    new_outs: List[Any] = []
    for node, value in zip(outs, values):
        leaves, spec = flatten(value)
        if not isinstance(node, fx.Node) or spec.is_leaf() or not leaves:
            specs.append(None)
            new_outs.append(node)
            continue
        with gm.graph.inserting_before(out_node):
            items = [gm.graph.call_function(output_leaf, (node, k)) for k in range(len(leaves))]
        for made in items:
            made.meta.update({k: v for k, v in node.meta.items() if k in ("fxpipe_module", "stack_trace")})
        new_outs += items
        specs.append(spec)
    if not any(s is not None for s in specs):
        return
    out_node.args = (tuple(new_outs),)
    gm.graph.lint()
    gm.recompile()
    captured.out_spec = compose_out_spec(captured.out_spec, specs)
