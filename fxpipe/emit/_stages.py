"""Emit one ``torch.fx.GraphModule`` per pipeline stage from a captured graph and its Plan.

Input: the captured ``GraphModule`` (flat placeholders, flat output tuple) and the
:class:`~fxpipe.plan._value.Plan` made for it. Output: :class:`Stages`. The plan's routes
(:mod:`fxpipe.plan._routes`) say what each stage receives, returns, stashes and pops; emission only
writes them down, so the printed plan is what runs:

* a boundary edge ``k -> k + 1``: stage ``k`` returns the value, stage ``k + 1`` receives it
  as a placeholder of the same name;
* a portal ``i -> j``: stage ``i`` calls ``stash(name, value)`` right after producing it and
  stage ``j`` calls ``value = pop(name)`` right after its placeholders;
* ``get_attr`` nodes are never transferred: each stage that uses a parameter/buffer
  re-materialises it, so the stage reads the model's own object (tied weights stay tied
  and their gradients sum, exactly like eager);
* stage 0 receives every model input; the last stage returns the model's flat output
  tuple with constants kept in place;
* node names, ``call_module`` targets and ``node.meta`` (stack traces) are kept, so each
  stage's ``.code`` reads like the model and errors point back at the original source.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx

from fxpipe.errors import EmitError
from fxpipe.plan._op_graph import build_opgraph
from fxpipe.plan._value import Plan
from fxpipe.portals import pop, stash
from fxpipe.plan._routes import Route, routes
from fxpipe.emit._stage_module import StageModule, annotate_stage_exception, source_comment

__all__ = ["EmitError", "StageModule", "Stages", "annotate_stage_exception", "emit_stages"]


@dataclass
class Stages:
    """The emitted stages of a pipeline; indexing and iterating give the stage modules.

    ``modules[k]`` is stage ``k`` (a :class:`StageModule`, i.e. a ``GraphModule`` sharing the
    model's parameters and submodules). ``input_names[k]`` are its placeholders,
    ``output_names[k]`` the values it returns (for the last stage: the model's flat
    output leaves, a constant leaf written as its ``repr``). ``portals`` are the plan's
    portal routes, one stash/pop pair each.
    """

    modules: list[torch.fx.GraphModule]
    portals: list[Route] = field(default_factory=list)
    input_names: list[list[str]] = field(default_factory=list)
    output_names: list[list[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[torch.fx.GraphModule]:
        return iter(self.modules)

    def __getitem__(self, k: int) -> torch.fx.GraphModule:
        return self.modules[k]

    def stashes(self, k: int) -> list[Route]:
        """The portals stage ``k`` stashes, in route order."""
        return [p for p in self.portals if p.src == k]

    def pops(self, k: int) -> list[Route]:
        """The portals stage ``k`` pops, in route order."""
        return [p for p in self.portals if p.dst == k]

    def stage_code(self, k: int, source: bool = True) -> str:
        """Readable Python of stage ``k`` (its ``.code``); with ``source`` each block of
        lines is preceded by a ``# File "...", line N, in fn: code`` comment naming the
        original model source it comes from."""
        mod = self.modules[k]
        code = source_comment(mod) if source else mod.code
        return code.strip("\n") + "\n"

    def header(self, k: int) -> str:
        """Comment lines naming stage ``k``'s inputs, outputs, stashes and pops."""
        lines = [f"# ---- stage {k} ----",
                 f"# inputs : {', '.join(self.input_names[k]) or '-'}",
                 f"# outputs: {', '.join(self.output_names[k]) or '-'}"]
        lines += [f"# stash  : {p.name} -> stage {p.dst}" for p in self.stashes(k)]
        lines += [f"# pop    : {p.name} <- stage {p.src}" for p in self.pops(k)]
        return "\n".join(lines)

    def describe(self, k: int) -> str:
        """Stage ``k`` as printed by ``fxpipe code``: its header, then its code."""
        return self.header(k) + "\n" + self.stage_code(k)

    def __str__(self) -> str:
        return "\n".join(self.describe(k) for k in range(len(self.modules)))


def _leaves(arg: Any) -> list[Any]:
    """Leaves of a (possibly nested) output argument, in order."""
    if isinstance(arg, (tuple, list)):
        return [leaf for a in arg for leaf in _leaves(a)]
    if isinstance(arg, dict):
        return [leaf for a in arg.values() for leaf in _leaves(a)]
    return [arg]


def _stage_of(node: torch.fx.Node, assignment: dict[str, int], last: int) -> int:
    if node.op == "placeholder":
        stage = assignment.get(node.name, 0)
        if stage != 0:
            raise EmitError(f"placeholder {node.name!r} is assigned to stage {stage}; inputs belong to stage 0")
        return 0
    if node.op == "output":
        stage = assignment.get(node.name, last)
        if stage != last:
            raise EmitError(f"the output node is assigned to stage {stage}; it belongs to the last stage {last}")
        return last
    if node.name not in assignment:
        raise EmitError(f"node {node.name!r} ({node.op} {node.target}) has no stage in the assignment")
    raw = assignment[node.name]
    try:
        stage = operator.index(raw)  # accepts numpy integers too
    except TypeError:
        stage = None
    if stage is None or not 0 <= stage <= last:
        raise EmitError(f"node {node.name!r} is assigned to stage {raw!r}, outside 0..{last}")
    return stage


def _meta_without_source(node: torch.fx.Node) -> dict[str, Any]:
    meta = dict(node.meta)
    meta.pop("stack_trace", None)
    return meta



def emit_stages(gm: torch.fx.GraphModule, plan: Plan) -> Stages:
    """Cut ``gm`` into the stages of ``plan``, one ``GraphModule`` each.

    The plan must have been made for this graph (``Plan.from_assignment`` on its OpGraph, or a
    saved plan of the same model): :class:`EmitError` says what does not match.
    """
    stage = _checked_stages(gm, plan)
    return Stages(
        modules=[_emit_stage(gm, plan, stage, k) for k in range(plan.n_stages)],
        portals=plan.portals,
        input_names=[_inputs(gm, plan, k) for k in range(plan.n_stages)],
        output_names=[_output_names(gm, plan, k) for k in range(plan.n_stages)],
    )


def _checked_stages(gm: torch.fx.GraphModule, plan: Plan) -> dict[str, int]:
    """The stage of every node but ``get_attr`` (re-materialised where used), after checking
    that the plan fits ``gm``: every node placed, inputs in stage 0, the output in the last
    stage, and the plan's routes the ones its assignment implies."""
    if plan.n_stages < 1:
        raise EmitError(f"n_stages must be >= 1, got {plan.n_stages}")
    last = plan.n_stages - 1
    nodes = list(gm.graph.nodes)
    unknown = sorted(set(plan.assignment) - {n.name for n in nodes})
    if unknown:
        raise EmitError(f"assignment names nodes that are not in the graph: {unknown[:5]}")
    stage = {n.name: _stage_of(n, plan.assignment, last) for n in nodes if n.op != "get_attr"}
    try:
        implied = routes(build_opgraph(gm), stage)
    except ValueError as e:
        raise EmitError(f"{e}; producers must be in the same or an earlier stage") from None
    key = [(r.value, r.src, r.dst) for r in implied]
    if key != [(r.value, r.src, r.dst) for r in plan.routes]:
        given = {(r.value, r.src, r.dst) for r in plan.routes}
        lost = [f"{v} {s}->{d}" for v, s, d in key if (v, s, d) not in given]
        odd = [f"{v} {s}->{d}" for v, s, d in sorted(given - set(key), key=str)]
        raise EmitError(
            "the plan's routes are not the ones its assignment implies for this graph "
            f"(missing: {lost[:5] or '-'}; not implied: {odd[:5] or '-'}); make the plan again with "
            "Plan.from_assignment, or rebuild the pipeline without plan= to re-plan"
        )
    return stage


def _inputs(gm: torch.fx.GraphModule, plan: Plan, k: int) -> list[str]:
    """Stage ``k``'s placeholders: the model's inputs for stage 0, else its boundary edges."""
    if k == 0:
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [r.value for r in plan.edges if r.dst == k]


def _output_names(gm: torch.fx.GraphModule, plan: Plan, k: int) -> list[str]:
    if k < plan.n_stages - 1:
        return [r.value for r in plan.edges if r.src == k]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [leaf.name if isinstance(leaf, torch.fx.Node) else repr(leaf) for leaf in _leaves(output.args[0])]


def _emit_stage(gm: torch.fx.GraphModule, plan: Plan, stage: dict[str, int], k: int) -> StageModule:
    """Stage ``k``: placeholders, pops, its nodes in graph order (each followed by its stashes,
    and the ``get_attr`` s it uses), then its outputs."""
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    stashes: dict[str, list[str]] = {}
    for p in plan.portals:
        if p.src == k:
            stashes.setdefault(p.value, []).append(p.name)

    def stash_after(node: torch.fx.Node) -> None:
        for name in stashes.get(node.name, ()):
            st = graph.create_node("call_function", stash, (name, env[node]), name=f"stash_{name}")
            st.meta["fxpipe_portal"] = name

    # 1. placeholders: the model's inputs for stage 0, boundary values otherwise.
    inputs = [by_name[name] for name in _inputs(gm, plan, k)]
    for value in inputs:
        if k == 0:
            env[value] = graph.node_copy(value, env.__getitem__)
        else:
            env[value] = graph.placeholder(value.name, type_expr=value.type)
            env[value].meta = _meta_without_source(value)
    # 2. pops of the portals that end here, and (stage 0) stashes of model inputs.
    for p in plan.portals:
        if p.dst == k:
            value = by_name[p.value]
            env[value] = graph.create_node("call_function", pop, (p.name,), name=value.name, type_expr=value.type)
            env[value].meta = {**_meta_without_source(value), "fxpipe_portal": p.name}
    for value in inputs if k == 0 else ():
        stash_after(value)
    # 3. this stage's nodes in graph order, each followed by its stashes; a get_attr
    #    wherever this stage uses it.
    used_attrs = {inp for n in gm.graph.nodes if stage.get(n.name) == k
                  for inp in n.all_input_nodes if inp.op == "get_attr"}
    for node in gm.graph.nodes:
        if node in used_attrs:
            env[node] = graph.node_copy(node, env.__getitem__)
        elif node.op not in ("get_attr", "placeholder", "output") and stage[node.name] == k:
            env[node] = graph.node_copy(node, env.__getitem__)
            stash_after(node)
    # 4. output: the next stage's boundary values, or the model's outputs.
    if k == plan.n_stages - 1:
        graph.node_copy(next(n for n in reversed(gm.graph.nodes) if n.op == "output"), env.__getitem__)
    else:
        graph.output(tuple(env[by_name[r.value]] for r in plan.edges if r.src == k))
    graph.lint()
    return StageModule(gm, graph, class_name=f"Stage{k}", stage_index=k)
