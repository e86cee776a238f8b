"""What crosses stages: the one classification of values into boundary edges and portals.

A value made in stage ``src`` and used in a later stage ``dst`` travels one of two ways:

* ``dst == src + 1``: a **boundary edge**. Stage ``src`` returns it and stage ``dst``
  receives it as an argument, named after the value.
* ``dst > src + 1``: a **portal** named ``portal_name(value, dst)``. Stage ``src`` stashes it
  right after making it and stage ``dst`` pops it, skipping the stages in between (torchgpipe's
  skip connections), so the middle stages neither hold nor copy it.

One route exists per (value, consuming stage): a value read by stages 1 and 3 of a value made
in stage 0 has an edge to 1 and a portal to 3. Parameters and buffers (``get_attr``) never
travel: every stage reads the model's own tensors.

The Plan stores the routes; emission, the runtime's skip layout and the printed plan all read
them from there, so what a plan says is what runs. This module is pure (networkx, no torch) so
plans can be made and checked on machines without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import networkx as nx

from fxpipe.plan._partition import is_value, value_bytes

__all__ = ["Route", "routes", "portal_name"]


def portal_name(value: str, dst: int) -> str:
    """Name of the portal carrying ``value`` to stage ``dst`` (one per consuming stage)."""
    return f"{value}__to{dst}"


@dataclass(frozen=True)
class Route:
    """The value named ``value`` (an fx node name) sent from stage ``src`` to stage ``dst``.

    ``bytes`` is the size of one send as profiled (0 when the graph was not profiled).
    """

    value: str
    src: int
    dst: int
    bytes: int

    @property
    def is_portal(self) -> bool:
        """Whether the value skips at least one stage (a stash/pop pair), not a boundary edge."""
        return self.dst > self.src + 1

    @property
    def name(self) -> str:
        """How stage code names it: the portal's name, or the value's for a boundary edge
        (the receiving stage's argument)."""
        return portal_name(self.value, self.dst) if self.is_portal else self.value


def routes(graph: nx.DiGraph, assignment: Mapping[str, int]) -> list[Route]:
    """Every value that leaves its stage, one :class:`Route` per consuming stage.

    ``graph`` is an OpGraph (nodes with ``op``, ``index``, ``out_bytes``; an edge per use) and
    ``assignment`` maps each of its nodes to a stage. Routes are ordered by source stage, then
    destination stage, then the value's position in the graph: the order stage arguments,
    stashes and pops take in generated code.

    Raises ValueError when a node uses a value made in a later stage.
    """
    nodes = graph.nodes

    def position(n: str) -> tuple[int, str]:
        return (nodes[n].get("index", 0), str(n))

    found: list[tuple[int, int, tuple[int, str], Route]] = []
    for u in graph.nodes:
        if not is_value(nodes[u].get("op")):
            continue  # parameters (get_attr) are shared, never sent
        src = assignment[u]
        later: set[int] = set()
        for v in graph.successors(u):
            dst = assignment[v]
            if dst < src:
                raise ValueError(
                    f"{v!r} (stage {dst}) consumes {u!r} from a later stage ({src}); "
                    "values can only flow to the same or a later stage"
                )
            if dst > src:
                later.add(dst)
        size = value_bytes(graph, u) if later else 0
        for dst in later:
            found.append((src, dst, position(u), Route(str(u), src, dst, size)))
    found.sort(key=lambda t: t[:3])
    return [route for *_, route in found]
