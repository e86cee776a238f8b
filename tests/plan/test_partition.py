"""partition.py against brute force: the cut must be *exactly* optimal, not just good."""

from __future__ import annotations

import contextlib
import itertools
import random
import signal

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.plan._partition import partition, split_chain, stage_costs, topological_order

COMPUTE = ("call_module", "call_function", "call_method")


def _add(g: nx.DiGraph, name: str, op: str, **attrs) -> None:
    g.add_node(name, index=g.number_of_nodes(), op=op, target=name, module="", shape="", **attrs)


def _finish(g: nx.DiGraph) -> nx.DiGraph:
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = g.nodes[u].get("out_bytes", 0)
    return g


@st.composite
def op_graphs(draw) -> nx.DiGraph:
    """Small fx-like DAGs: placeholders, maybe a get_attr, a chain of compute nodes with random
    long edges (from placeholders and earlier nodes, to compute nodes and to the output)."""
    g = nx.DiGraph()
    n_ph = draw(st.integers(1, 2))
    m = draw(st.integers(3, 9))
    cost = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    size = st.integers(0, 1000)
    phs = [f"x{i}" for i in range(n_ph)]
    for p in phs:
        _add(g, p, "placeholder", out_bytes=draw(size))
    has_attr = draw(st.booleans())
    if has_attr:
        _add(g, "w", "get_attr", param_bytes=draw(size), out_bytes=draw(size))
    producers: list[str] = list(phs)
    attr_at = draw(st.integers(0, m - 1))
    for i in range(m):
        name = f"c{i}"
        op = draw(st.sampled_from(COMPUTE))
        _add(g, name, op, cost=draw(cost), out_bytes=draw(size), param_bytes=draw(size))
        g.add_edge(producers[-1], name)
        for src in draw(st.lists(st.sampled_from(producers), max_size=3)):
            g.add_edge(src, name)
        if has_attr and i == attr_at:
            g.add_edge("w", name)
        producers.append(name)
    _add(g, "output", "output")
    g.add_edge(producers[-1], "output")
    for src in draw(st.lists(st.sampled_from(producers), max_size=2)):
        g.add_edge(src, "output")
    return _finish(g)


def _cost_by_definition(g: nx.DiGraph, assign: dict[str, int], spb: float) -> list[float]:
    """The spec's stage cost, written independently of the library."""
    n = max(assign.values()) + 1
    out = []
    for s in range(n):
        compute = sum(g.nodes[v].get("cost", 0.0) for v in g if assign[v] == s)
        recv = {
            u
            for u, v in g.edges
            if assign[v] == s and assign[u] < s and g.nodes[u]["op"] != "get_attr"
        }
        out.append(compute + spb * sum(g.nodes[u].get("out_bytes", 0) for u in recv))
    return out


def _brute_force(g: nx.DiGraph, k: int, spb: float) -> float:
    order = topological_order(g)
    comp = [n for n in order if g.nodes[n]["op"] in COMPUTE]
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(comp)), k - 1):
        assign = {n: sum(i >= c for c in cuts) for i, n in enumerate(comp)}
        for n in order:
            op = g.nodes[n]["op"]
            if op == "placeholder":
                assign[n] = 0
            elif op == "output":
                assign[n] = k - 1
        for n in order:
            if n not in assign:  # get_attr: with its first consumer
                assign[n] = assign[next(u for u in order if g.has_edge(n, u))]
        best = min(best, max(_cost_by_definition(g, assign, spb)))
    return best


def _check_placement(g: nx.DiGraph, assign: dict[str, int], k: int) -> None:
    order = topological_order(g)
    comp = [n for n in order if g.nodes[n]["op"] in COMPUTE]
    stages = [assign[n] for n in comp]
    assert stages == sorted(stages) and set(stages) == set(range(k))  # contiguous, none empty
    for n in order:
        op = g.nodes[n]["op"]
        if op == "placeholder":
            assert assign[n] == 0
        elif op == "output":
            assert assign[n] == k - 1
        elif op == "get_attr":
            users = [u for u in order if g.has_edge(n, u)]
            assert assign[n] == (assign[users[0]] if users else 0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=op_graphs(), spb=st.sampled_from([0.0, 0.003, 0.05]))
def test_partition_matches_brute_force(g: nx.DiGraph, spb: float) -> None:
    m = sum(g.nodes[n]["op"] in COMPUTE for n in g)
    for k in range(1, m + 1):
        assign = partition(g, k, seconds_per_byte=spb)
        _check_placement(g, assign, k)
        got = _cost_by_definition(g, assign, spb)
        assert stage_costs(g, assign, seconds_per_byte=spb) == pytest.approx(got, rel=1e-12, abs=1e-12)
        assert max(got) == pytest.approx(_brute_force(g, k, spb), rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=9), data=st.data())
def test_split_chain_matches_brute_force(costs: list[float], data) -> None:
    n = len(costs)
    k = data.draw(st.integers(1, n))
    sizes = split_chain(costs, k)
    assert len(sizes) == k and all(s >= 1 for s in sizes) and sum(sizes) == n
    bounds = [0] + list(itertools.accumulate(sizes))
    got = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )
    assert got == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_split_chain_params_exact() -> None:
    # balance_by_size-style: one huge layer. Optimal is the huge layer alone (bottleneck 100);
    # torchgpipe's block-partition heuristic does not guarantee this.
    params = [10, 10, 100, 10, 10, 10, 10]
    assert split_chain(params, 3) == [2, 1, 4]
    assert split_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # bottleneck 17
    assert max(map(sum, [[1, 2, 3, 4, 5], [6, 7], [8, 9]])) == 17
    assert split_chain([5, 5, 5, 5], 4) == [1, 1, 1, 1]
    # Tie-break among optimal splits: the last stage starts as late as possible.
    assert split_chain([1, 1, 1, 1, 1], 2) == [3, 2]
    assert split_chain([0, 0, 0], 2) == [2, 1]


def test_split_chain_errors() -> None:
    with pytest.raises(ValueError, match=r"n_parts=5.*3"):
        split_chain([1, 2, 3], 5)
    with pytest.raises(ValueError, match=r"n_parts=0"):
        split_chain([1, 2, 3], 0)
    with pytest.raises(ValueError, match=">= 0"):
        split_chain([1, -2, 3], 2)


def _chain(costs, out_bytes=None, extra_edges=()) -> nx.DiGraph:
    g = nx.DiGraph()
    _add(g, "x", "placeholder", out_bytes=8)
    _add(g, "w", "get_attr", param_bytes=64)
    prev = "x"
    for i, c in enumerate(costs):
        _add(g, f"c{i}", "call_module", cost=c, out_bytes=(out_bytes or [4] * len(costs))[i])
        g.add_edge(prev, f"c{i}")
        prev = f"c{i}"
    _add(g, "out", "output")
    g.add_edge(prev, "out")
    g.add_edge("w", "c2")
    g.add_edges_from(extra_edges)
    return _finish(g)


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Fail (instead of hanging the run) if the body takes longer; no-op where unsupported."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def _expired(*_):
        raise TimeoutError(f"took more than {seconds}s")

    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _regression_graph(costs, out_bytes, edges) -> nx.DiGraph:
    g = nx.DiGraph()
    for name in ("x0", "x1"):
        _add(g, name, "placeholder", out_bytes=out_bytes.get(name, 0))
    for i, c in enumerate(costs):
        _add(g, f"c{i}", "call_module", cost=c, out_bytes=out_bytes.get(f"c{i}", 0))
    _add(g, "output", "output")
    g.add_edges_from(edges)
    return _finish(g)


@pytest.mark.parametrize(
    "g",
    [
        # Found by test_partition_matches_brute_force (k=3, spb=0.05 hung for good): stage
        # starts whose prefix cost C[a] is denormal/tiny next to the transfer cost x. The old
        # reach() fixed its threshold on C[b] up one ulp of C[a] at a time, and fl(c - C[a]) + x
        # only moves every ulp(x)/2: ~2**50+ steps, 100% CPU in _Chain.reach.
        _regression_graph(
            [5e-324, 1.3436521437096175e-108, 1.3436521437096175e-108, 4.585530283810074],
            {"x0": 327, "x1": 37, "c0": 390, "c1": 288, "c2": 31, "c3": 118},
            [("x1", "c0"), ("c0", "c1"), ("c0", "c2"), ("c1", "c2"), ("c2", "c3"), ("c3", "output")],
        ),
        # Also found: equal 1e-5 costs, ~2**18 ulp steps per probe (seconds per call).
        _regression_graph(
            [1e-05, 1e-05, 1e-05],
            {"x0": 211, "c0": 87, "c1": 838, "c2": 442},
            [("x0", "c0"), ("x0", "c1"), ("x0", "c2"), ("c0", "c1"), ("c0", "c2"), ("c0", "output"),
             ("c1", "c2"), ("c2", "output")],
        ),
        # Zero compute: C[a] == 0, so the optimal bottleneck is a pure transfer x and the walk
        # started at 0 and went through every denormal.
        _chain([0.0] * 5, out_bytes=[3, 5, 7, 11, 13]),
    ],
    ids=["denormal-costs", "equal-tiny-costs", "zero-costs"],
)
@pytest.mark.parametrize("spb", [0.003, 0.05, 1e-300, 1e100])
def test_partition_tiny_costs_terminate_exactly(g: nx.DiGraph, spb: float) -> None:
    m = sum(g.nodes[n]["op"] in COMPUTE for n in g)
    for k in range(1, m + 1):
        with _time_limit(10):
            assign = partition(g, k, seconds_per_byte=spb)
        _check_placement(g, assign, k)
        got = max(_cost_by_definition(g, assign, spb))
        assert got == pytest.approx(_brute_force(g, k, spb), rel=1e-9, abs=1e-12)


def test_placement_and_determinism() -> None:
    g = _chain([1, 1, 1, 1, 1, 1])
    a = partition(g, 3)
    assert a == partition(g, 3)
    assert a["x"] == 0 and a["out"] == 2 and a["w"] == a["c2"]
    assert [a[f"c{i}"] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    # Same result whatever order networkx happens to store the nodes in.
    h = nx.DiGraph()
    h.add_nodes_from(reversed(list(g.nodes(data=True))))
    h.add_edges_from(reversed(list(g.edges(data=True))))
    assert partition(h, 3) == a


def test_transfer_cost_moves_the_cut() -> None:
    # c1's output is huge: cutting right after c1 would make stage 1 receive it.
    g = _chain([1, 1, 1, 1], out_bytes=[1, 1000, 1, 1])
    assert [partition(g, 2)[f"c{i}"] for i in range(4)] == [0, 0, 1, 1]
    a = partition(g, 2, seconds_per_byte=0.01)  # receiving c1 costs 10s: cut elsewhere
    assert [a[f"c{i}"] for i in range(4)] == [0, 0, 0, 1]
    assert max(stage_costs(g, a, seconds_per_byte=0.01)) == pytest.approx(3.0)


def test_skip_value_paid_once_by_consumer_only() -> None:
    g = _chain([1, 1, 1, 1], out_bytes=[100, 1, 1, 1], extra_edges=[("c0", "c3"), ("c0", "out")])
    a = partition(g, 4, seconds_per_byte=0.01)
    # Stage 3 = {c3, out} receives c2 (1 byte) and c0 once (100 bytes); stage 2 receives c1.
    assert stage_costs(g, a, seconds_per_byte=0.01) == pytest.approx([1.0, 2.0, 1.01, 2.01])


def test_n_stages_errors() -> None:
    g = _chain([1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"n_stages=9 but the graph has only 5 partitionable"):
        partition(g, 9)
    with pytest.raises(ValueError, match=r"n_stages=0.*5"):
        partition(g, 0)
    with pytest.raises(ValueError, match="every node"):
        partition(g, 2, order=["x", "c0"])
    with pytest.raises(ValueError, match="not topological"):
        partition(g, 2, order=["x", "w", "c1", "c0", "c2", "c3", "c4", "out"])


def test_split_before() -> None:
    g = _chain([5, 1, 1, 1, 1, 1])
    a = partition(g, 3, split_before=["c1", "c5"])
    assert [a[f"c{i}"] for i in range(6)] == [0, 1, 1, 1, 1, 2]
    assert a["w"] == 1 and a["out"] == 2
    with pytest.raises(ValueError, match="needs exactly 2"):
        partition(g, 3, split_before=["c1"])
    with pytest.raises(ValueError, match="strictly increasing"):
        partition(g, 3, split_before=["c3", "c1"])
    with pytest.raises(ValueError, match="first compute node"):
        partition(g, 2, split_before=["c0"])
    with pytest.raises(ValueError, match="'w' is not a partitionable"):
        partition(g, 2, split_before=["w"])


def test_custom_order_and_cost_attr() -> None:
    g = _chain([1, 1, 1, 1])
    for i, t in enumerate([4, 1, 1, 1]):
        g.nodes[f"c{i}"]["time2"] = t
    a = partition(g, 2, cost_attr="time2")
    assert [a[f"c{i}"] for i in range(4)] == [0, 1, 1, 1]
    # Two independent branches: the given order decides what is contiguous.
    h = nx.DiGraph()
    _add(h, "x", "placeholder")
    for name in ("a1", "b1", "a2", "b2"):
        _add(h, name, "call_function", cost=1.0)
    _add(h, "out", "output")
    h.add_edges_from([("x", "a1"), ("x", "b1"), ("a1", "a2"), ("b1", "b2"), ("a2", "out"), ("b2", "out")])
    a = partition(h, 2, order=["x", "a1", "a2", "b1", "b2", "out"])
    assert (a["a1"], a["a2"], a["b1"], a["b2"]) == (0, 0, 1, 1)


def _big_graph(n: int, seed: int = 0) -> nx.DiGraph:
    """Chain-ish graph with residual-style skips, a few long ones and a reused input."""
    rng = random.Random(seed)
    g = nx.DiGraph()
    g.add_node("x", index=0, op="placeholder", out_bytes=4096)
    prev = "x"
    for i in range(1, n - 1):
        name = f"n{i}"
        g.add_node(name, index=i, op="call_function", cost=rng.random() * 1e-3, out_bytes=rng.randint(1, 1 << 20))
        g.add_edge(prev, name)
        if i > 5 and rng.random() < 0.2:
            back = rng.randint(2, 5) if rng.random() < 0.9 else rng.randint(2, min(i - 1, 200))
            g.add_edge(f"n{i - back}", name)
        if rng.random() < 0.02:
            g.add_edge("x", name)
        prev = name
    g.add_node("out", index=n - 1, op="output")
    g.add_edge(prev, "out")
    return g


@pytest.mark.slow
def test_20k_nodes() -> None:
    """Every stage used on a 20,000-node chain (its speed is measured beside eager in
    benchmarks/planning.py's chain-20k, not asserted here: timings follow the machine)."""
    g = _big_graph(20_000)
    for k in (2, 4, 8):
        a = partition(g, k, seconds_per_byte=1e-8)
        assert sorted(set(a.values())) == list(range(k))


def test_balanced_by_parameters_every_stage_holds_some_where_a_cut_allows():
    # a trial: four parameterised layers in four stages, and one stage of a GELU alone (the cut
    # with the latest starts among the optimal ones): its rank's optimizer got an empty list
    import torch
    from torch import nn

    import fxpipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 32))
    pipe = fxpipe.pipeline(model, torch.randint(0, 32, (8, 6)), 4, chunks=4, devices=["cpu"] * 4,
                           balance_by="params", progress=False)
    assert all(stage.param_bytes > 0 for stage in pipe.plan.stages), pipe.plan
    assert pipe.plan.stages[2].param_bytes == max(stage.param_bytes for stage in pipe.plan.stages)
