"""A plan's cut carried over to another capture of the same model (no torch).

A graph that bakes the training mode in (torch.export, a traced ``self.training``) is captured
again when the model's modes change (:mod:`fxpipe._mode_variants`). That capture differs in a
few nodes (dropout's flag, BatchNorm's statistics updates, a ``contiguous`` the eval path skips)
and fx numbers its nodes anew (``mul_3`` is another op in each), so names alone cannot carry the
plan. Nodes are matched by their place in the graph's order and what they are (op, target,
module), as ``difflib`` matches lines; a matched node keeps its stage, a new one goes with the
latest stage among its inputs (the earliest that keeps every value flowing forward), and a node
without inputs with its first user. The cut is not re-planned: the stages keep what they hold.
"""

from __future__ import annotations

import difflib
from typing import Hashable

import networkx as nx

__all__ = ["carry_assignment", "CarryError"]

#: at most this share of the new graph may be nodes the old one does not have
MAX_UNMATCHED = 0.25


class CarryError(ValueError):
    """The plan does not carry over: the graphs differ too much, or (raised by
    ``fxpipe.build.plan_carried_over``) a value would flow back."""


def _key(graph: nx.DiGraph, n: str) -> Hashable:
    data = graph.nodes[n]
    return (data.get("op"), data.get("target"), data.get("module", ""))


def _in_order(graph: nx.DiGraph) -> list[str]:
    return sorted(graph.nodes, key=lambda n: (graph.nodes[n].get("index", 0), str(n)))


def carry_assignment(old: nx.DiGraph, assignment: dict[str, int], new: nx.DiGraph) -> dict[str, int]:
    """``{node of new: stage}`` with the cut of ``assignment`` (made for ``old``).

    Raises :class:`CarryError` when more than ``MAX_UNMATCHED`` of ``new``'s nodes have no
    counterpart (another model rather than another mode of it). A value that would flow to an
    earlier stage is refused where every assignment is, by the routes of
    ``Plan.from_assignment`` (:mod:`fxpipe.plan._routes`).
    """
    before, after = _in_order(old), _in_order(new)
    matcher = difflib.SequenceMatcher(None, [_key(old, n) for n in before], [_key(new, n) for n in after],
                                      autojunk=False)
    carried: dict[str, int] = {}
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            carried[after[block.b + i]] = assignment[before[block.a + i]]
    unmatched = len(after) - len(carried)
    if unmatched > MAX_UNMATCHED * max(len(after), 1):
        raise CarryError(f"{unmatched} of the {len(after)} nodes of the new capture have no counterpart in the "
                         "planned one")
    last = max(assignment.values(), default=0)
    for n in after:  # inputs before users: a new node goes with the latest of its inputs
        if n in carried:
            continue
        op = new.nodes[n].get("op")
        if op == "placeholder":
            carried[n] = 0
        elif op == "output":
            carried[n] = last
        else:
            inputs = [carried[p] for p in new.predecessors(n) if new.nodes[p].get("op") != "get_attr"
                      and p in carried]
            carried[n] = max(inputs) if inputs else -1
    for n in reversed(after):  # a node without inputs (a constant, a parameter): with its first user
        if carried[n] < 0:
            users = [carried[s] for s in new.successors(n) if carried[s] >= 0]
            carried[n] = min(users) if users else 0
    return carried
