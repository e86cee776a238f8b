"""The Plan: what goes where, as a plain value you can print, save, load and diff (no torch).

A Plan is derived from an OpGraph and a node -> stage assignment. Besides the stages it
lists every activation that crosses a stage boundary: to the next stage (``BoundaryEdge``)
or past one or more stages (``Portal``, sent straight to the consumer, named by
``portal_name``, which the code emitter relies on).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from os import PathLike
from typing import Any, Mapping

import networkx as nx

from fxpipe.partition import _is_value, stage_costs, value_bytes

__all__ = ["FORMAT", "StageInfo", "BoundaryEdge", "Portal", "Plan", "portal_name", "human_bytes"]

#: JSON format tag; bump on incompatible changes so old files fail loudly, not subtly.
FORMAT = "fxpipe.plan/1"


def portal_name(value: str, dst: int) -> str:
    """Name of the portal carrying ``value`` to stage ``dst`` (one per consuming stage)."""
    return f"{value}__to{dst}"


@dataclass
class StageInfo:
    index: int
    nodes: list[str]
    cost: float
    param_bytes: int
    act_in_bytes: int
    act_out_bytes: int


@dataclass
class BoundaryEdge:
    """A value sent from stage ``src`` to the next stage ``dst == src + 1``."""

    value: str
    src: int
    dst: int
    bytes: int


@dataclass
class Portal:
    """A value sent from stage ``src`` directly to a later stage ``dst > src + 1``."""

    name: str
    value: str
    src: int
    dst: int
    bytes: int


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_cost(cost: float, balance_by: str) -> str:
    """A stage cost in its unit: seconds for 'time', bytes for 'memory' and 'params'
    (parameter bytes: what a stage must hold), else a plain number."""
    if balance_by == "time":
        return f"{cost * 1e3:.3f} ms"
    if balance_by in ("size", "memory", "bytes", "params"):
        return human_bytes(cost)
    return f"{cost:.6g}"


@dataclass
class Plan:
    n_stages: int
    balance_by: str
    assignment: dict[str, int]
    stages: list[StageInfo]
    edges: list[BoundaryEdge]
    portals: list[Portal]
    meta: dict[str, Any] = field(default_factory=dict)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_assignment(
        cls,
        graph: nx.DiGraph,
        assignment: Mapping[str, int],
        *,
        balance_by: str = "time",
        cost_attr: str = "cost",
        seconds_per_byte: float = 0.0,
        meta: dict[str, Any] | None = None,
    ) -> "Plan":
        """Derive stages, boundary edges and portals from ``{node: stage}``.

        Raises ValueError if a node is unassigned or a value would have to flow backwards.
        """
        nodes = graph.nodes
        missing = [n for n in graph.nodes if n not in assignment]
        if missing:
            raise ValueError(f"assignment has no stage for {len(missing)} node(s), e.g. {missing[:3]}")
        extra = [n for n in assignment if n not in nodes]
        if extra:
            raise ValueError(f"assignment names nodes not in the graph, e.g. {extra[:3]}")
        assign = {n: int(s) for n, s in assignment.items()}
        if any(s < 0 for s in assign.values()):
            raise ValueError("stage indices must be >= 0")
        n_stages = max(assign.values(), default=-1) + 1

        def key(n: str) -> tuple[int, str]:
            return (nodes[n].get("index", 0), str(n))

        edges: list[BoundaryEdge] = []
        portals: list[Portal] = []
        for u in sorted(graph.nodes, key=key):
            if not _is_value(nodes[u].get("op")):
                continue  # parameters (get_attr) are shared, never sent
            src = assign[u]
            dsts = set()
            for v in graph.successors(u):
                dst = assign[v]
                if dst < src:
                    raise ValueError(
                        f"{v!r} (stage {dst}) consumes {u!r} from a later stage ({src}); "
                        "values can only flow to the same or a later stage"
                    )
                if dst > src:
                    dsts.add(dst)
            size = value_bytes(graph, u) if dsts else 0
            for dst in sorted(dsts):
                if dst == src + 1:
                    edges.append(BoundaryEdge(str(u), src, dst, size))
                else:
                    portals.append(Portal(portal_name(str(u), dst), str(u), src, dst, size))
        rank = {n: i for i, n in enumerate(sorted(graph.nodes, key=key))}
        edges.sort(key=lambda e: (e.src, e.dst, rank[e.value]))
        portals.sort(key=lambda p: (p.src, p.dst, rank[p.value]))

        costs = stage_costs(graph, assign, cost_attr=cost_attr, seconds_per_byte=seconds_per_byte)
        costs += [0.0] * (n_stages - len(costs))
        members: list[list[str]] = [[] for _ in range(n_stages)]
        for n in sorted(assign, key=key):
            members[assign[n]].append(str(n))
        stages = []
        for s in range(n_stages):
            seen: set[tuple[str, str]] = set()  # a shared module's / tied parameter counts once
            params = 0
            for n in members[s]:
                data = nodes[n]
                op = data.get("op")
                if op == "get_attr" or op == "call_module":
                    tkey = (op, str(data.get("target", n)))
                    if tkey in seen:
                        continue
                    seen.add(tkey)
                params += int(data.get("param_bytes") or 0)
            act_in = sum(x.bytes for x in (*edges, *portals) if x.dst == s)
            act_out = sum(x.bytes for x in (*edges, *portals) if x.src == s)
            stages.append(StageInfo(s, members[s], float(costs[s]), params, act_in, act_out))
        return cls(n_stages, balance_by, assign, stages, edges, portals, dict(meta or {}))

    def stage_of(self, node: str) -> int:
        try:
            return self.assignment[node]
        except KeyError:
            raise KeyError(f"node {node!r} is not part of this plan") from None

    # -- display ---------------------------------------------------------------------------
    def __str__(self) -> str:
        head = ["stage", "nodes", "first .. last", "cost", "params", "act in", "act out"]
        rows = []
        for st in self.stages:
            span = f"{st.nodes[0]} .. {st.nodes[-1]}" if st.nodes else "-"
            rows.append([
                str(st.index), str(len(st.nodes)), span, format_cost(st.cost, self.balance_by),
                human_bytes(st.param_bytes), human_bytes(st.act_in_bytes), human_bytes(st.act_out_bytes),
            ])
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

        def line(r: list[str]) -> str:  # names left-aligned, numbers right-aligned
            return "  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

        out = [f"Plan: {self.n_stages} stages, balanced by {self.balance_by}", line(head)]
        out += [line(r) for r in rows]
        out.append(f"boundary edges ({len(self.edges)}):")
        out += [f"  {e.value}  {e.src}->{e.dst}  {human_bytes(e.bytes)}" for e in self.edges]
        out.append(f"portals ({len(self.portals)}):")
        out += [f"  {p.name}  ({p.value})  {p.src}->{p.dst}  {human_bytes(p.bytes)}" for p in self.portals]
        costs = [st.cost for st in self.stages]
        if costs:
            worst = max(range(len(costs)), key=costs.__getitem__)
            mean = sum(costs) / len(costs)
            ratio = costs[worst] / mean if mean > 0 else 1.0
            out.append(
                f"bottleneck: stage {worst} ({format_cost(costs[worst], self.balance_by)}); "
                f"balance ratio max/mean = {ratio:.3f}"
            )
        return "\n".join(out)

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        d = json.loads(s)
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt != FORMAT:
            raise ValueError(f"not an fxpipe plan: format is {fmt!r}, expected {FORMAT!r}")
        return cls(
            n_stages=int(d["n_stages"]),
            balance_by=d["balance_by"],
            assignment={k: int(v) for k, v in d["assignment"].items()},
            stages=[StageInfo(**x) for x in d["stages"]],
            edges=[BoundaryEdge(**x) for x in d["edges"]],
            portals=[Portal(**x) for x in d["portals"]],
            meta=d.get("meta", {}),
        )

    def save(self, path: str | PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | PathLike[str]) -> "Plan":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())
