"""The Plan: what goes where, as a plain value you can print, save, load and diff (no torch).

A Plan is derived from an OpGraph and a node -> stage assignment. Besides the stages it
holds every route a value takes between stages (:mod:`fxpipe.plan._routes`): to the next stage
(``edges``) or past one or more stages (``portals``). Emission and the runtime read the
routes from the plan, so a saved plan is by construction what runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from os import PathLike, fspath
from typing import Any, Mapping

import networkx as nx

from fxpipe.errors import PlanError, PlanFileError, PlanNotFoundError, PlanPathError
from fxpipe.plan._partition import stage_costs
from fxpipe.plan._routes import Route, portal_name, routes

__all__ = ["FORMAT", "StageInfo", "Route", "Plan", "portal_name", "human_bytes"]

#: JSON format tag; bump on incompatible changes so old files fail loudly, not subtly.
FORMAT = "fxpipe.plan._value/1"


@dataclass
class StageInfo:
    index: int
    nodes: list[str]
    cost: float
    param_bytes: int
    act_in_bytes: int
    act_out_bytes: int


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
    #: every value sent between stages, ordered by (src, dst, position in the graph)
    routes: list[Route]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def edges(self) -> list[Route]:
        """The routes to the next stage: stage ``src`` returns the value, ``dst`` receives it."""
        return [r for r in self.routes if not r.is_portal]

    @property
    def portals(self) -> list[Route]:
        """The routes that skip stages: one stash/pop pair each in the stage code."""
        return [r for r in self.routes if r.is_portal]

    @property
    def reused_costs(self) -> dict[str, str]:
        """``{node: node whose measured time it reuses}``: the nodes not timed themselves,
        because an identical node (same module code, parameter and input shapes) was
        (:mod:`fxpipe.plan._cost_keys`). Empty for plans that timed nothing, or were made before
        fxpipe recorded it."""
        costs = self.meta.get("costs") if isinstance(self.meta, dict) else None
        found = costs.get("reused_from") if isinstance(costs, dict) else None
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

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
        """Derive stages and routes from ``{node: stage}``.

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
        sent = routes(graph, assign)

        costs = stage_costs(graph, assign, cost_attr=cost_attr, seconds_per_byte=seconds_per_byte)
        costs += [0.0] * (n_stages - len(costs))
        members: list[list[str]] = [[] for _ in range(n_stages)]
        for n in sorted(assign, key=lambda n: (nodes[n].get("index", 0), str(n))):
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
            act_in = sum(r.bytes for r in sent if r.dst == s)
            act_out = sum(r.bytes for r in sent if r.src == s)
            stages.append(StageInfo(s, members[s], float(costs[s]), params, act_in, act_out))
        return cls(n_stages, balance_by, assign, stages, sent, dict(meta or {}))

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
        counted = self.meta.get("costs") if isinstance(self.meta, dict) else None
        if isinstance(counted, dict) and counted.get("measured"):
            chunks = self.meta.get("chunks", 1)
            on = f"one micro-batch (of {chunks})" if isinstance(chunks, int) and chunks > 1 else "the sample"
            out.append(f"costs: {counted.get('measured')} nodes timed on {on}, {counted.get('reused', 0)} reused "
                       "from an identical node (same module code, parameter and input shapes)")
        notes = self.meta.get("warnings") if isinstance(self.meta, dict) else None
        out += [f"warning: {w}" for w in (notes or []) if isinstance(w, str)]
        return "\n".join(out)

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON text. Routes are written as ``edges`` and ``portals`` (a portal
        with its ``name``), the layout of every plan file so far."""
        body = asdict(self)
        del body["routes"]
        body["edges"] = [_route_json(r) for r in self.edges]
        body["portals"] = [{"name": r.name, **_route_json(r)} for r in self.portals]
        return json.dumps({"format": FORMAT, **body}, indent=1)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        """A Plan from :meth:`to_json` text; :class:`~fxpipe.errors.PlanError` if it is not one."""
        return _plan_from_text(cls, s, None)

    def save(self, path: str | PathLike[str]) -> None:
        """Write the plan as JSON; reuse it with ``Plan.load(path)`` or ``pipeline(..., plan=path)``."""
        where = _check_path(path, "save")
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.to_json())
        except OSError as e:
            raise _file_error(e, where, "cannot write the plan to",
                              "pass a path in an existing, writable directory") from e

    @classmethod
    def load(cls, path: str | PathLike[str]) -> "Plan":
        """Read a plan written by :meth:`save`.

        Raises :class:`~fxpipe.errors.PlanError` naming the file when it is missing
        (:class:`~fxpipe.errors.PlanNotFoundError`), unreadable, not JSON, or not a plan.
        """
        where = _check_path(path, "load")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise PlanError(f"plan file {where!r} is not a text (JSON) file ({e.reason} at byte {e.start}); "
                            f"{_REMAKE}", path=where) from e
        except OSError as e:
            raise _file_error(e, where, "cannot read the plan file", _REMAKE) from e
        return _plan_from_text(cls, text, where)


# -- reading plans ---------------------------------------------------------------------------
_REMAKE = ("pass the path of a file written by plan.save(path), or make a new plan "
           "(omit plan=, or run `fxpipe plan ... --save PATH`) and save it again")


def _check_path(path: Any, verb: str) -> str:
    """The path as text, for messages; :class:`PlanPathError` unless it is a str/PathLike."""
    if isinstance(path, (str, PathLike)):
        return str(fspath(path))
    if isinstance(path, bytes):
        return path.decode(errors="replace")
    what = type(path).__name__
    hint = ""
    if isinstance(path, dict):
        hint = " (for a plan already parsed from JSON, use Plan.from_json(json.dumps(d)))"
    if verb == "save":
        raise PlanPathError(f"plan.save(path): path must be a str or os.PathLike naming the JSON file "
                            f"to write, got {what}")
    raise PlanPathError(f"a plan path must be a str or os.PathLike naming a JSON file written by "
                        f"plan.save(path), or pass the Plan object itself; got {what}{hint}")


def _file_error(e: OSError, where: str, doing: str, todo: str) -> PlanError:
    if isinstance(e, FileNotFoundError):
        return PlanNotFoundError(f"{doing} {where!r}: no such file or directory; {todo}", path=where)
    if isinstance(e, IsADirectoryError):
        return PlanFileError(f"{doing} {where!r}: it is a directory, not a file; {todo}", path=where)
    reason = e.strerror or type(e).__name__
    return PlanFileError(f"{doing} {where!r}: {reason}; {todo}", path=where)


# (field, check, description) of every key a plan file must have
_FIELDS: list[tuple[str, type, str]] = [
    ("n_stages", int, "an integer"),
    ("balance_by", str, "a string"),
    ("assignment", dict, "an object {node: stage}"),
    ("stages", list, "a list"),
    ("edges", list, "a list"),
    ("portals", list, "a list"),
]


_EDGE_KEYS = ["value", "src", "dst", "bytes"]


def _route_json(r: Route) -> dict[str, Any]:
    return {"value": r.value, "src": r.src, "dst": r.dst, "bytes": r.bytes}


def _plan_from_text(cls: type, text: str, where: str | None) -> "Plan":
    src = f"plan file {where!r}" if where is not None else "plan JSON"
    todo = _REMAKE if where is not None else "pass the text written by plan.to_json()"
    if not isinstance(text, (str, bytes, bytearray)):
        raise PlanPathError(f"Plan.from_json expects the JSON text (str), got {type(text).__name__}; "
                            "to read a file use Plan.load(path)")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        body = text.strip() if isinstance(text, str) else text.decode(errors="replace").strip()
        cut = (e.pos >= len(body) or e.msg.startswith("Unterminated")
               or (body[:1] in "{[" and body[-1:] not in "}]"))
        if not body:
            raise PlanError(f"{src} is empty; {todo}", path=where) from None
        raise PlanError(f"{src} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno})"
                        f"{'; it looks truncated' if cut else ''}; {todo}", path=where) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise PlanError(f"{src} is not valid JSON ({e}); {todo}", path=where) from None
    fmt = d.get("format") if isinstance(d, dict) else None
    if fmt != FORMAT:
        got = f"format is {fmt!r}" if isinstance(d, dict) else f"it holds a JSON {type(d).__name__}"
        raise PlanError(f"{src} is not an fxpipe plan: {got}, expected {FORMAT!r}; {todo}", path=where)
    missing = [k for k, _, _ in _FIELDS if k not in d]
    if missing:
        raise PlanError(f"{src} is not a complete fxpipe plan: it has no {', '.join(map(repr, missing))}; {todo}",
                        path=where)
    for key, typ, desc in _FIELDS:
        value = d[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise PlanError(f"{src}: {key!r} must be {desc}, got {type(value).__name__}; {todo}", path=where)

    def entries(key: str, names: list[str], kind: str) -> list[dict[str, Any]]:
        out = []
        for i, x in enumerate(d[key]):
            if not isinstance(x, dict):
                raise PlanError(f"{src}: {key}[{i}] must be an object with keys {names}, "
                                f"got {type(x).__name__}; {todo}", path=where)
            lacks, extra = [n for n in names if n not in x], [k for k in x if k not in names]
            if lacks or extra:
                what = "; ".join(([f"it has no {', '.join(map(repr, lacks))}"] if lacks else [])
                                 + ([f"unknown {', '.join(map(repr, extra))}"] if extra else []))
                raise PlanError(f"{src}: {key}[{i}] is not a {kind} ({what}); {todo}", path=where)
            out.append(x)
        return out

    def route(key: str, i: int, x: dict[str, Any]) -> Route:
        r = Route(str(x["value"]), x["src"], x["dst"], x["bytes"])
        portal = key == "portals"
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (r.src, r.dst, r.bytes))
        if not ok or not 0 <= r.src < r.dst < n or r.is_portal != portal or (portal and x["name"] != r.name):
            want = "dst > src + 1 and name == f'{value}__to{dst}'" if portal else "dst == src + 1"
            raise PlanError(f"{src}: {key}[{i}] ({x}) is not a valid route: a {key[:-1]} needs integer "
                            f"stages 0 <= src < dst < {n} with {want}; {todo}", path=where)
        return r

    n = d["n_stages"]
    bad = [(k, v) for k, v in d["assignment"].items()
           if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n]
    if n < 1 or bad:
        what = f"n_stages is {n}" if n < 1 else f"node {bad[0][0]!r} has stage {bad[0][1]!r}, not in 0..{n - 1}"
        raise PlanError(f"{src} is inconsistent: {what}; {todo}", path=where)
    stages = [StageInfo(**x) for x in entries("stages", [f.name for f in fields(StageInfo)], "StageInfo")]
    if len(stages) != n:
        raise PlanError(f"{src} is inconsistent: n_stages is {n} but it lists {len(stages)} stages; {todo}",
                        path=where)
    sent = [route("edges", i, x) for i, x in enumerate(entries("edges", _EDGE_KEYS, "edge"))]
    sent += [route("portals", i, x) for i, x in enumerate(entries("portals", ["name", *_EDGE_KEYS], "portal"))]
    meta = d.get("meta", {})
    return cls(
        n_stages=n,
        balance_by=d["balance_by"],
        assignment=dict(d["assignment"]),
        stages=stages,
        routes=sorted(sent, key=lambda r: (r.src, r.dst)),  # stable: each list is in graph order
        meta=meta if isinstance(meta, dict) else {},
    )
