"""OpGraph: a networkx view of a captured GraphModule with costs on nodes and bytes on edges.

Why a separate, torch-free value: the partitioner and the renderers only need names,
order, costs and sizes. Keys are fx node names so a plan can be mapped back to the graph.
"""

from __future__ import annotations

from typing import Any, Mapping

import networkx as nx
from torch import fx

from ._profile import NodeCost

__all__ = ["build_opgraph", "collapse_by_depth", "target_str"]


def target_str(node: fx.Node) -> str:
    """Readable target: ``torch.relu``, ``operator.add``, ``'layer1.0.conv1'``, ``'view'``."""
    t = node.target
    if isinstance(t, str):
        return t
    try:
        return fx.node._get_qualified_name(t)
    except Exception:  # noqa: BLE001 - OpOverloads and odd callables
        return str(t)


def build_opgraph(gm: fx.GraphModule, costs: Mapping[str, NodeCost] | None = None) -> nx.DiGraph:
    """Nodes = fx nodes (attrs index, op, target, module, seconds, param_count, param_bytes,
    out_bytes, shape);
    an edge u -> v for every use of u by v, with ``bytes`` = u's out_bytes.

    Without ``costs`` every number is 0 and shapes are ''.
    """
    g = nx.DiGraph()
    g.graph["model"] = type(gm).__name__
    costs = costs or {}
    for i, n in enumerate(gm.graph.nodes):
        c = costs.get(n.name)
        g.add_node(n.name, index=i, op=n.op, target=target_str(n), module=n.meta.get("fxpipe_module", ""),
                   seconds=c.seconds if c else 0.0, param_count=c.param_count if c else 0,
                   param_bytes=c.param_bytes if c else 0,
                   out_bytes=c.out_bytes if c else 0, shape=c.shape if c else "",
                   keep_with=list(n.meta.get("fxpipe_keep_with", ())))
    for n in gm.graph.nodes:
        for u in n.all_input_nodes:
            g.add_edge(u.name, n.name, bytes=g.nodes[u.name]["out_bytes"])
    return g


def _group_key(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) if module and depth > 0 else ""


def collapse_by_depth(opgraph: nx.DiGraph, depth: int) -> nx.DiGraph:
    """Merge nodes whose ``module`` shares its first ``depth`` name components.

    For drawing large graphs: ``depth=1`` gives one node per top-level submodule. Nodes at
    the root (``module == ''``) stay individual. Merged nodes sum ``seconds``, ``param_count``, ``param_bytes``
    and ``out_bytes``, keep the smallest ``index`` and list their ``members``; an edge
    between groups sums the bytes of the distinct source nodes crossing it. The result may
    contain cycles when the model goes in and out of a submodule.
    """
    names = set(opgraph.nodes)
    group_of: dict[str, str] = {}
    for name, attrs in opgraph.nodes(data=True):
        key = _group_key(attrs.get("module", ""), depth)
        if key and key in names and opgraph.nodes[key].get("module", "") != key:
            key += "/"  # a root-level node already uses this name
        group_of[name] = key or name
    out = nx.DiGraph()
    out.graph.update(opgraph.graph)
    out.graph["depth"] = depth
    for name, attrs in sorted(opgraph.nodes(data=True), key=lambda kv: kv[1].get("index", 0)):
        key = group_of[name]
        if key not in out:
            merged = key != name or attrs.get("module", "") == key
            out.add_node(key, **dict(attrs), members=[], size=0)
            if merged:
                out.nodes[key].update(op="group", target=key, module=key.rstrip("/"), seconds=0.0,
                                      param_count=0, param_bytes=0, out_bytes=0, shape="")
        node = out.nodes[key]
        node["members"].append(name)
        node["size"] += 1
        if node["op"] == "group":
            for field in ("seconds", "param_count", "param_bytes", "out_bytes"):
                node[field] += attrs.get(field, 0)
    crossing: dict[tuple[str, str], dict[str, Any]] = {}
    for u, v, data in opgraph.edges(data=True):
        gu, gv = group_of[u], group_of[v]
        if gu != gv:
            sources = crossing.setdefault((gu, gv), {})
            sources[u] = data.get("bytes", 0)  # a tensor crosses once per destination group
    for (gu, gv), sources in crossing.items():
        out.add_edge(gu, gv, bytes=sum(sources.values()))
    return out
