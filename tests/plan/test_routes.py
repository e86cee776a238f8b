"""Routes: the one classification of values crossing stages, and a plan that is what runs.

A plan saved to JSON and loaded again must emit exactly the stages it describes: the portals
its printout lists are the stash/pop pairs in the stage code, and its boundary edges are the
stages' arguments and return values.
"""

from __future__ import annotations

import re

import networkx as nx
import pytest

import fxpipe
from fxpipe.plan._routes import Route, portal_name, routes
from tests.exact import assert_exact
from tests.zoo import ZOO


def _chain_with_skips() -> nx.DiGraph:
    """x -> a -> b -> c -> out, with x read by c and a read by out; w a parameter of b."""
    g = nx.DiGraph()
    for i, (name, op) in enumerate([("x", "placeholder"), ("w", "get_attr"), ("a", "call_function"),
                                    ("b", "call_module"), ("c", "call_method"), ("out", "output")]):
        g.add_node(name, index=i, op=op, out_bytes=10 * (i + 1))
    g.add_edges_from([("x", "a"), ("a", "b"), ("w", "b"), ("b", "c"), ("x", "c"), ("c", "out"), ("a", "out")])
    return g


def test_one_route_per_consuming_stage() -> None:
    g = _chain_with_skips()
    assign = {"x": 0, "w": 2, "a": 0, "b": 2, "c": 3, "out": 3}
    got = routes(g, assign)
    assert got == [Route("a", 0, 2, 30), Route("x", 0, 3, 10), Route("a", 0, 3, 30), Route("b", 2, 3, 40)]
    assert [r.is_portal for r in got] == [True, True, True, False]
    assert [r.name for r in got] == ["a__to2", "x__to3", "a__to3", "b"]
    assert portal_name("a", 3) == "a__to3"
    # parameters never travel, whatever stage their node is in
    assert all(r.value != "w" for r in got)


def test_same_stage_uses_send_nothing_and_backward_flow_is_refused() -> None:
    g = _chain_with_skips()
    assert routes(g, dict.fromkeys(g.nodes, 0)) == []
    with pytest.raises(ValueError, match="'b' \\(stage 0\\) consumes 'a' from a later stage \\(1\\)"):
        routes(g, {"x": 0, "w": 0, "a": 1, "b": 0, "c": 1, "out": 1})


def _printed_portals(plan: fxpipe.Plan) -> list[tuple[str, int, int]]:
    """The ``portals (n):`` section of ``str(plan)``, parsed back."""
    text = str(plan).splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("portals ("))
    count = int(re.match(r"portals \((\d+)\):", text[start]).group(1))
    out = []
    for line in text[start + 1:start + 1 + count]:
        name, _, span, *_ = line.split()
        src, dst = span.split("->")
        out.append((name, int(src), int(dst)))
    return out


def _stage_portal_calls(pipe: fxpipe.Pipeline) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(portal name, stage) of every stash and every pop call in the stage code."""
    stashes, pops = [], []
    for k in range(pipe.n_stages):
        code = pipe.stages[k].code
        stashes += [(name, k) for name in re.findall(r"fxpipe_portals_stash\('(\w+)'", code)]
        pops += [(name, k) for name in re.findall(r"fxpipe_portals_pop\('(\w+)'\)", code)]
    return stashes, pops


@pytest.mark.parametrize("model_name, n_stages", [("unet", 3), ("unet", 4), ("gpt_tied", 4), ("inception_block", 3)])
def test_a_plan_loaded_from_json_emits_the_stages_it_describes(tmp_path, model_name, n_stages) -> None:
    model, args, _ = ZOO[model_name]()
    planned = fxpipe.pipeline(model, args, n_stages, devices=["cpu"] * n_stages, balance_by="params")
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    pipe = fxpipe.pipeline(model, args, n_stages, chunks=2, devices=["cpu"] * n_stages, plan=path)
    plan = pipe.plan
    assert plan == planned.plan

    printed = _printed_portals(plan)
    assert printed == [(p.name, p.src, p.dst) for p in plan.portals]
    stashes, pops = _stage_portal_calls(pipe)
    assert sorted(stashes) == sorted((name, src) for name, src, _ in printed)
    assert sorted(pops) == sorted((name, dst) for name, _, dst in printed)
    for k in range(n_stages):
        sig = list(pipe.stages[k].graph.find_nodes(op="placeholder"))
        if k > 0:  # boundary edges are the arguments, in route order
            assert [n.name for n in sig] == [e.value for e in plan.edges if e.dst == k]
    if model_name == "unet":
        assert printed, "the U-Net's long skips must become portals"
    assert_exact(model, args, n_stages, chunks=2, plan=path, balance_by="params")
