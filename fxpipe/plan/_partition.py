"""Ordering and cutting an OpGraph into pipeline stages (no torch: graphs and numbers only).

The cut is *contiguous* in a topological order: stage ``s`` owns one run of compute nodes.
A stage's cost is its compute time plus the time to receive the activations it needs from
earlier stages (``seconds_per_byte`` * bytes of the distinct values it receives). Values that
skip stages travel directly (portals), so only the consuming stage pays for them.

This module turns the graph into that chain problem (positions, a receive table, nodes that
must share a stage) and back into ``{node: stage}``; :mod:`fxpipe.plan._chain_cut` solves it exactly.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import networkx as nx
import numpy as np

from fxpipe.plan._chain_cut import Chain, split_chain
from fxpipe.capture._node_kinds import COMPUTE_OPS
from fxpipe.errors import SplitPointsError, StagesError

__all__ = [
    "COMPUTE_OPS",
    "topological_order",
    "split_chain",
    "partition",
    "stage_costs",
    "value_bytes",
    "is_value",
]

#: fx ops that do work and may be cut between stages.


def _num(data: Mapping[str, Any], key: str) -> float:
    """A numeric node attribute; missing (or None) counts as 0."""
    value = data.get(key)
    return 0.0 if value is None else float(value)


def is_value(op: str | None) -> bool:
    """Whether a node's output can travel between stages (get_attr parameters never do)."""
    return op == "placeholder" or op in COMPUTE_OPS


def value_bytes(graph: nx.DiGraph, node: str) -> int:
    """Bytes of ``node``'s output: ``out_bytes``, else the largest ``bytes`` of its out-edges."""
    data = graph.nodes[node]
    if data.get("out_bytes") is not None:
        return int(data["out_bytes"])
    return max((int(d.get("bytes") or 0) for _, _, d in graph.out_edges(node, data=True)), default=0)


def topological_order(graph: nx.DiGraph) -> list[str]:
    """Topological order that follows the original fx order (``index``) wherever it can.

    The fx order is already topological, so this normally *is* the fx order; the key only
    matters for graphs edited after tracing. Ties on index fall back to the node name.
    """
    nodes = graph.nodes
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: (nodes[n].get("index", 0), str(n))))


class _Problem:
    """An OpGraph seen as a chain of compute positions plus a receive table."""

    def __init__(self, graph: nx.DiGraph, order: Sequence[str] | None, cost_attr: str, spb: float):
        if order is None:
            order = topological_order(graph)
        else:
            order = list(order)
            if len(order) != graph.number_of_nodes() or set(order) != set(graph.nodes):
                raise ValueError("order must list every node of the graph exactly once")
        ops: dict[str, Any] = dict(graph.nodes(data="op"))
        out_bytes: dict[str, Any] = dict(graph.nodes(data="out_bytes"))
        succ = {u: list(nbrs) for u, nbrs in graph.adjacency()}
        self.order = order
        compute = [n for n in order if ops[n] in COMPUTE_OPS]
        # Nodes that must share a stage (``keep_with``) make every position between them one
        # indivisible unit: a cut can only fall before a unit's first node.
        self.pos = pos = _units(graph, compute)
        self.compute = [n for i, n in enumerate(compute) if i == 0 or pos[n] != pos[compute[i - 1]]]
        m = len(self.compute)
        last = max(m - 1, 0)
        rank = {n: i for i, n in enumerate(order)}
        # glue[n]: the compute position whose stage node n joins.
        glue: dict[str, int] = {}
        for n in order:
            op = ops[n]
            if op in COMPUTE_OPS:
                glue[n] = pos[n]
            elif op == "placeholder":
                glue[n] = 0
            elif op == "output":
                glue[n] = last
        for n in order:  # get_attr (and anything else): with its first consumer, else stage 0
            if n not in glue:
                users = sorted((u for u in succ[n] if u in glue), key=rank.__getitem__)
                glue[n] = glue[users[0]] if users else 0
        self.glue = glue
        self.costs = [0.0] * m
        if m:
            for n, c in graph.nodes(data=cost_attr):
                self.costs[glue[n]] += 0.0 if c is None else float(c)
        # One rectangle per (value, consumer position): see chain_cut.Chain.
        rects: list[tuple[int, int, int, int]] = []
        for u in order:
            op = ops[u]
            if not is_value(op):
                continue
            p = glue[u]
            qs = set()
            for v in succ[u]:
                vop = ops[v]
                if vop in COMPUTE_OPS:
                    q = pos[v]
                    if op != "placeholder" and q < p:
                        raise ValueError(f"order is not topological: {v!r} comes before its input {u!r}")
                    if q > p or op == "placeholder":
                        qs.add(q)
                elif vop == "output":
                    qs.add(last)
            if not qs:
                continue
            w = out_bytes[u]
            w = value_bytes(graph, u) if w is None else int(w)
            prev = p
            for q in sorted(qs):
                rects.append((prev + 1, q, q + 1, w))
                prev = q
        self.chain = Chain(self.costs, rects, spb) if m else None

    def assign(self, starts: Sequence[int]) -> dict[str, int]:
        st = np.asarray(starts)
        stage_at = np.searchsorted(st, np.arange(len(self.compute)), side="right") - 1
        return {n: int(stage_at[self.glue[n]]) for n in self.order}


def _units(graph: nx.DiGraph, compute: Sequence[str]) -> dict[str, int]:
    """Unit index of each compute node: consecutive positions, merged across ``keep_with`` spans."""
    index = {n: i for i, n in enumerate(compute)}
    reach = list(range(len(compute)))  # reach[i]: the last position that must share i's stage
    for n, keep in graph.nodes(data="keep_with"):
        if not keep or n not in index:
            continue
        for other in keep:
            if other in index:
                a, b = sorted((index[n], index[other]))
                reach[a] = max(reach[a], b)
    units: dict[str, int] = {}
    unit, end = -1, -1
    for i, n in enumerate(compute):
        if i > end:
            unit += 1
        end = max(end, reach[i])
        units[n] = unit
    return units


def _check_n_stages(n_stages: int, m: int) -> None:
    if not isinstance(n_stages, (int, np.integer)) or n_stages < 1 or n_stages > m:
        raise StagesError(
            f"n_stages={n_stages} but the graph has only {m} partitionable nodes "
            f"(call_module/call_function/call_method); use 1 <= n_stages <= {m}", argument="n_stages"
        )


def _starts_from_split_before(prob: _Problem, split_before: Sequence[str], n_stages: int) -> list[int]:
    names = list(split_before)
    if len(names) != n_stages - 1:
        raise SplitPointsError(
            f"split_before has {len(names)} names but n_stages={n_stages} needs exactly {n_stages - 1}",
            argument="split_before")
    starts = [0]
    for name in names:
        if name not in prob.pos:
            raise SplitPointsError(f"split_before: {name!r} is not a partitionable (compute) node of the graph",
                                   argument="split_before")
        p = prob.pos[name]
        if prob.compute[p] != name:
            raise SplitPointsError(
                f"split_before: {name!r} is inside a group of nodes that must share one stage (from "
                f"{prob.compute[p]!r}: an in-place update of a buffer, an op filling a copy, or a value "
                "computed in torch.inference_mode() and its uses); "
                "split before or after the group", argument="split_before")
        if p <= starts[-1]:
            what = "the first compute node" if p == 0 else f"at or before {prob.compute[starts[-1]]!r}"
            raise SplitPointsError(
                f"split_before: {name!r} is {what}; names must be strictly increasing in the order "
                "and must not start at the first compute node (every stage needs a node)", argument="split_before")
        starts.append(p)
    return starts


def partition(
    graph: nx.DiGraph,
    n_stages: int,
    *,
    cost_attr: str = "cost",
    seconds_per_byte: float = 0.0,
    split_before: Sequence[str] | None = None,
    order: Sequence[str] | None = None,
) -> dict[str, int]:
    """Assign every node to a stage, minimising the slowest stage exactly for the order.

    Placeholders go to stage 0, the output to the last stage, get_attr nodes to the stage of
    their first consumer (parameters are shared, never sent). ``split_before`` pins the cut
    points instead of balancing. Returns ``{node: stage}``.
    """
    if seconds_per_byte < 0:
        raise ValueError(f"seconds_per_byte must be >= 0, got {seconds_per_byte}")
    prob = _Problem(graph, order, cost_attr, float(seconds_per_byte))
    _check_n_stages(n_stages, len(prob.compute))
    if split_before is not None:
        starts = _starts_from_split_before(prob, split_before, n_stages)
    else:
        assert prob.chain is not None
        starts = prob.chain.solve(int(n_stages))
    return prob.assign(starts)


def stage_costs(
    graph: nx.DiGraph,
    assignment: Mapping[str, int],
    *,
    cost_attr: str = "cost",
    seconds_per_byte: float = 0.0,
) -> list[float]:
    """Per-stage cost by the definition ``partition`` optimises, computed straightforwardly.

    Compute: sum of ``cost_attr`` over the stage's nodes. Transfer: ``seconds_per_byte`` times
    the bytes of the distinct values (placeholder/compute outputs) made in an earlier stage
    and used by any node of this one.
    """
    n = max(assignment.values(), default=-1) + 1
    compute = [0.0] * n
    received: list[set[str]] = [set() for _ in range(n)]
    nodes = graph.nodes
    for node, s in assignment.items():
        compute[s] += _num(nodes[node], cost_attr)
    for u, v in graph.edges:
        if is_value(nodes[u].get("op")) and assignment[u] < assignment[v]:
            received[assignment[v]].add(u)
    return [
        c + seconds_per_byte * sum(value_bytes(graph, u) for u in r) for c, r in zip(compute, received)
    ]
