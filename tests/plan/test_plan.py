"""Plan: boundary edges vs portals, the printed table, and JSON persistence."""

from __future__ import annotations

import json

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.plan._partition import partition, stage_costs
from fxpipe.plan._value import Plan, Route, StageInfo, portal_name

SPB = 1e-6


def _graph() -> nx.DiGraph:
    """x -> a -> b -> c -> d -> out, plus a->d, x->d (skips) and b->out; w, w2 share target p."""
    g = nx.DiGraph()
    spec = [
        ("x", "placeholder", "x", 0.0, 0, 8),
        ("w", "get_attr", "p", 0.0, 40, 40),
        ("a", "call_module", "l1", 1e-3, 100, 16),
        ("b", "call_function", "add", 2e-3, 0, 32),
        ("w2", "get_attr", "p", 0.0, 40, 40),
        ("c", "call_module", "l2", 1e-3, 200, 64),
        ("d", "call_function", "cat", 1e-3, 0, 4),
        ("out", "output", "output", 0.0, 0, 0),
    ]
    for i, (name, op, target, cost, params, out) in enumerate(spec):
        g.add_node(name, index=i, op=op, target=target, module="", cost=cost, param_bytes=params,
                   out_bytes=out, shape="")
    g.add_edges_from([("x", "a"), ("a", "b"), ("w", "b"), ("b", "c"), ("w2", "c"), ("c", "d"),
                      ("a", "d"), ("x", "d"), ("d", "out"), ("b", "out")])
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = g.nodes[u]["out_bytes"]
    return g


ASSIGN = {"x": 0, "a": 0, "w": 1, "b": 1, "w2": 1, "c": 1, "d": 2, "out": 2}


def _plan() -> Plan:
    return Plan.from_assignment(_graph(), ASSIGN, seconds_per_byte=SPB, meta={"model": "Toy", "nodes": 8})


def test_edges_and_portals_exact() -> None:
    plan = _plan()
    assert plan.n_stages == 3 and plan.balance_by == "time"
    assert plan.edges == [
        Route("a", 0, 1, 16),
        Route("b", 1, 2, 32),
        Route("c", 1, 2, 64),
    ]
    assert plan.portals == [
        Route("x", 0, 2, 8),
        Route("a", 0, 2, 16),
    ]
    assert portal_name("a", 2) == "a__to2"
    assert [r.name for r in plan.portals] == ["x__to2", "a__to2"]
    assert [r.name for r in plan.edges] == ["a", "b", "c"]  # the receiving stage's argument
    assert plan.routes == [*plan.edges[:1], *plan.portals, *plan.edges[1:]]  # by (src, dst)


# A plan file as written before the Plan stored routes (edges and portals as two lists):
# it must keep loading.
OLD_FILE = {
    "format": "fxpipe.plan._value/1", "n_stages": 3, "balance_by": "time",
    "assignment": ASSIGN,
    "stages": [{"index": k, "nodes": [], "cost": 0.0, "param_bytes": 0, "act_in_bytes": 0, "act_out_bytes": 0}
               for k in range(3)],
    "edges": [{"value": "a", "src": 0, "dst": 1, "bytes": 16}, {"value": "b", "src": 1, "dst": 2, "bytes": 32},
              {"value": "c", "src": 1, "dst": 2, "bytes": 64}],
    "portals": [{"name": "x__to2", "value": "x", "src": 0, "dst": 2, "bytes": 8},
                {"name": "a__to2", "value": "a", "src": 0, "dst": 2, "bytes": 16}],
    "meta": {},
}


def test_plan_files_written_before_routes_still_load() -> None:
    plan = Plan.from_json(json.dumps(OLD_FILE))
    assert plan.routes == _plan().routes
    written = json.loads(plan.to_json())
    assert written["edges"] == OLD_FILE["edges"] and written["portals"] == OLD_FILE["portals"]


@pytest.mark.parametrize("key, index, change, expect", [
    ("edges", 0, {"dst": 2}, "edges\\[0\\].*dst == src \\+ 1"),
    ("portals", 1, {"name": "a__to3"}, "portals\\[1\\].*name == "),
    ("portals", 0, {"dst": 1}, "portals\\[0\\].*dst > src \\+ 1"),
    ("portals", 0, {"dst": 7}, "0 <= src < dst < 3"),
    ("edges", 2, {"src": "1"}, "integer stages"),
])
def test_inconsistent_routes_are_refused(key, index, change, expect) -> None:
    d = json.loads(json.dumps(OLD_FILE))
    d[key][index].update(change)
    with pytest.raises(ValueError, match=expect):
        Plan.from_json(json.dumps(d))


def test_stage_info() -> None:
    plan = _plan()
    assert [s.nodes for s in plan.stages] == [["x", "a"], ["w", "b", "w2", "c"], ["d", "out"]]
    assert [s.param_bytes for s in plan.stages] == [100, 240, 0]  # target p counted once
    assert [s.act_in_bytes for s in plan.stages] == [0, 16, 120]
    assert [s.act_out_bytes for s in plan.stages] == [40, 96, 0]
    assert [s.cost for s in plan.stages] == pytest.approx([1e-3, 3.016e-3, 1.12e-3])
    assert [s.cost for s in plan.stages] == stage_costs(_graph(), ASSIGN, seconds_per_byte=SPB)
    assert plan.stage_of("w2") == 1
    with pytest.raises(KeyError, match="nope"):
        plan.stage_of("nope")


def test_str_table() -> None:
    text = str(_plan())
    lines = text.splitlines()
    assert lines[0] == "Plan: 3 stages, balanced by time"
    for header in ("stage", "nodes", "first .. last", "cost", "params", "act in", "act out"):
        assert header in lines[1]
    row0, row1, row2 = lines[2:5]
    assert row0.split()[:5] == ["0", "2", "x", "..", "a"] and "1.000 ms" in row0 and "100 B" in row0
    assert row1.split()[:5] == ["1", "4", "w", "..", "c"] and "3.016 ms" in row1 and "240 B" in row1
    assert row2.split()[:5] == ["2", "2", "d", "..", "out"] and "1.120 ms" in row2 and "120 B" in row2
    assert "boundary edges (3):" in text and "  b  1->2  32 B" in text
    assert "portals (2):" in text and "  x__to2  (x)  0->2  8 B" in text
    assert lines[-1] == "bottleneck: stage 1 (3.016 ms); balance ratio max/mean = 1.762"


def test_str_other_units() -> None:
    g = _graph()
    plan = Plan.from_assignment(g, ASSIGN, balance_by="params", cost_attr="param_bytes")
    assert "280" in str(plan).splitlines()[3]  # cost column: sum over nodes
    g.nodes["c"]["param_bytes"] = 3 << 20
    plan = Plan.from_assignment(g, ASSIGN, balance_by="size", cost_attr="param_bytes")
    assert "3.0 MiB" in str(plan).splitlines()[3]


def test_json_round_trip(tmp_path) -> None:
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["format"] == "fxpipe.plan._value/1"
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert isinstance(Plan.load(path).stages[0], StageInfo)


def test_bad_format() -> None:
    d = json.loads(_plan().to_json())
    d["format"] = "fxpipe.plan._value/2"
    with pytest.raises(ValueError, match=r"'fxpipe.plan._value/2'.*expected 'fxpipe.plan._value/1'"):
        Plan.from_json(json.dumps(d))
    del d["format"]
    with pytest.raises(ValueError, match="not an fxpipe plan"):
        Plan.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="not an fxpipe plan"):
        Plan.from_json("[1, 2]")


def test_backward_flow_rejected() -> None:
    bad = dict(ASSIGN, a=1, b=0)
    with pytest.raises(ValueError, match="'b' \\(stage 0\\) consumes 'a' from a later stage"):
        Plan.from_assignment(_graph(), bad)
    with pytest.raises(ValueError, match="no stage"):
        Plan.from_assignment(_graph(), {"x": 0})


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 12),
    skips=st.lists(st.tuples(st.integers(0, 11), st.integers(2, 6)), max_size=6),
    data=st.data(),
)
def test_plan_from_partition_is_consistent(n: int, skips, data) -> None:
    g = nx.DiGraph()
    g.add_node("x", index=0, op="placeholder", out_bytes=5)
    prev = "x"
    for i in range(n):
        g.add_node(f"c{i}", index=i + 1, op="call_function", cost=float(i % 3 + 1), out_bytes=10 + i)
        g.add_edge(prev, f"c{i}")
        prev = f"c{i}"
    g.add_node("out", index=n + 1, op="output")
    g.add_edge(prev, "out")
    for src, gap in skips:
        if src + gap < n:
            g.add_edge(f"c{src}", f"c{src + gap}")
    k = data.draw(st.integers(1, n))
    assign = partition(g, k, seconds_per_byte=0.01)
    plan = Plan.from_assignment(g, assign, seconds_per_byte=0.01)
    assert [s.cost for s in plan.stages] == stage_costs(g, assign, seconds_per_byte=0.01)
    moves = [(e.value, e.src, e.dst) for e in plan.edges] + [(p.value, p.src, p.dst) for p in plan.portals]
    expected = {(u, assign[u], assign[v]) for u, v in g.edges if assign[u] < assign[v]}
    assert sorted(moves) == sorted(expected) and len(moves) == len(set(moves))
    assert all(e.dst == e.src + 1 for e in plan.edges) and all(p.dst > p.src + 1 for p in plan.portals)
    assert sum(s.act_in_bytes for s in plan.stages) == sum(s.act_out_bytes for s in plan.stages)
    assert Plan.from_json(plan.to_json()) == plan
