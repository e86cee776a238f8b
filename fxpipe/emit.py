"""Emit one ``torch.fx.GraphModule`` per pipeline stage from a captured graph.

Input: the captured ``GraphModule`` (flat placeholders, flat output tuple) and an
``assignment`` node name -> stage index. Output: :class:`Stages`.

Rules:

* a value produced in stage ``i`` and consumed in stage ``i + 1`` is a *boundary* value:
  stage ``i`` returns it, stage ``i + 1`` receives it as a placeholder;
* a value consumed in stage ``j > i + 1`` travels by *portal* ``portal_name(value, j)``:
  stage ``i`` calls ``stash(name, value)`` right after producing it and stage ``j`` calls
  ``value = pop(name)`` right after its placeholders;
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
from fxpipe.stage_module import StageModule, annotate_stage_exception, source_comment
from fxpipe.plan import portal_name
from fxpipe.skip.functional import pop, stash

__all__ = ["EmitError", "StageModule", "Stages", "annotate_stage_exception", "emit_stages", "portal_name"]

# Dead-code elimination (ours or anyone's) must never drop a stash or a pop.
torch.fx.node.has_side_effect(stash)
torch.fx.node.has_side_effect(pop)


@dataclass
class Stages:
    """The emitted stages of a pipeline.

    ``modules[k]`` is stage ``k`` (a :class:`StageModule`, i.e. a ``GraphModule`` sharing the
    model's parameters and submodules). ``input_names[k]`` are its placeholders,
    ``output_names[k]`` the values it returns (for the last stage: the model's flat
    output leaves, a constant leaf written as its ``repr``). ``skip_routes`` maps each
    portal name to ``(src stage, dst stage)``.
    """

    modules: list[torch.fx.GraphModule]
    skip_routes: dict[str, tuple[int, int]] = field(default_factory=dict)
    input_names: list[list[str]] = field(default_factory=list)
    output_names: list[list[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[torch.fx.GraphModule]:
        return iter(self.modules)

    def __getitem__(self, k: int) -> torch.fx.GraphModule:
        return self.modules[k]

    def stashes(self, k: int) -> list[str]:
        """Portal names stage ``k`` stashes, in route order."""
        return [name for name, (src, _) in self.skip_routes.items() if src == k]

    def pops(self, k: int) -> list[str]:
        """Portal names stage ``k`` pops, in route order."""
        return [name for name, (_, dst) in self.skip_routes.items() if dst == k]

    def stage_code(self, k: int, source: bool = True) -> str:
        """Readable Python of stage ``k`` (its ``.code``); with ``source`` each block of
        lines is preceded by a ``# File "...", line N, in fn: code`` comment naming the
        original model source it comes from."""
        mod = self.modules[k]
        code = source_comment(mod) if source else mod.code
        return code.strip("\n") + "\n"

    def __str__(self) -> str:
        parts = []
        for k in range(len(self.modules)):
            header = [f"# ---- stage {k} ({type(self.modules[k]).__name__}) ----"]
            header.append(f"# inputs : {', '.join(self.input_names[k]) or '-'}")
            header.append(f"# outputs: {', '.join(self.output_names[k]) or '-'}")
            for name in self.stashes(k):
                header.append(f"# stash  : {name} -> stage {self.skip_routes[name][1]}")
            for name in self.pops(k):
                header.append(f"# pop    : {name} <- stage {self.skip_routes[name][0]}")
            parts.append("\n".join(header) + "\n" + self.stage_code(k))
        return "\n".join(parts)


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


def emit_stages(gm: torch.fx.GraphModule, assignment: dict[str, int], n_stages: int) -> Stages:
    """Cut ``gm`` into ``n_stages`` stage ``GraphModule`` s following ``assignment``.

    ``assignment`` maps node names to stage indices (placeholders and the output node may
    be omitted; ``get_attr`` nodes are ignored since every stage re-materialises the
    parameters it uses). Every producer must be in the same or an earlier stage than its
    consumers; violations raise :class:`EmitError`.
    """
    if n_stages < 1:
        raise EmitError(f"n_stages must be >= 1, got {n_stages}")
    last = n_stages - 1
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    known = {n.name for n in nodes}
    unknown = sorted(set(assignment) - known)
    if unknown:
        raise EmitError(f"assignment names nodes that are not in the graph: {unknown[:5]}")

    # Stage of every value-producing node (get_attr excluded: re-materialised per use).
    stage: dict[torch.fx.Node, int] = {}
    for node in nodes:
        if node.op != "get_attr":
            stage[node] = _stage_of(node, assignment, last)

    # Consumer stages of each value, and the stages that use each get_attr.
    consumers: dict[torch.fx.Node, set[int]] = {n: set() for n in stage}
    attr_stages: dict[torch.fx.Node, set[int]] = {}
    for node in nodes:
        if node.op == "get_attr":
            continue
        s = stage[node]
        for inp in node.all_input_nodes:
            if inp.op == "get_attr":
                attr_stages.setdefault(inp, set()).add(s)
                continue
            if stage[inp] > s:
                raise EmitError(
                    f"node {node.name!r} (stage {s}) uses {inp.name!r} from a later stage {stage[inp]}; "
                    "producers must be in the same or an earlier stage"
                )
            if stage[inp] < s:
                consumers[inp].add(s)

    # Boundary values (k -> k+1) and portal routes (i -> j > i+1), producer order.
    boundary: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]  # boundary[k]: k -> k+1
    routes: dict[str, tuple[int, int]] = {}
    stash_after: dict[torch.fx.Node, list[str]] = {}
    pops_at: list[list[tuple[str, torch.fx.Node]]] = [[] for _ in range(n_stages)]
    for node in sorted(consumers, key=order.__getitem__):
        src = stage[node]
        for dst in sorted(consumers[node]):
            if dst == src + 1:
                boundary[src].append(node)
            else:
                name = portal_name(node.name, dst)
                routes[name] = (src, dst)
                stash_after.setdefault(node, []).append(name)
                pops_at[dst].append((name, node))

    modules: list[torch.fx.GraphModule] = []
    input_names: list[list[str]] = []
    output_names: list[list[str]] = []
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for k in range(n_stages):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            return env[n]

        # 1. placeholders: all model inputs for stage 0, boundary values otherwise.
        if k == 0:
            for ph in placeholders:
                env[ph] = graph.node_copy(ph, arg)
            inputs = placeholders
        else:
            for value in boundary[k - 1]:
                new = graph.placeholder(value.name, type_expr=value.type)
                new.meta = _meta_without_source(value)
                env[value] = new
            inputs = boundary[k - 1]
        input_names.append([n.name for n in inputs])

        # 2. pops of the portals that end here.
        for name, value in pops_at[k]:
            new = graph.create_node("call_function", pop, (name,), name=value.name, type_expr=value.type)
            new.meta = _meta_without_source(value)
            new.meta["fxpipe_portal"] = name
            env[value] = new

        # 3. stashes of inputs (stage 0 only: later placeholders were produced earlier).
        def emit_stashes(value: torch.fx.Node) -> None:
            for name in stash_after.get(value, ()):
                st = graph.create_node("call_function", stash, (name, env[value]), name=f"stash_{name}")
                st.meta["fxpipe_portal"] = name

        if k == 0:
            for ph in placeholders:
                emit_stashes(ph)

        # 4. this stage's nodes in graph order; get_attr where this stage uses it.
        for node in nodes:
            if node.op == "get_attr":
                if k in attr_stages.get(node, ()):
                    env[node] = graph.node_copy(node, arg)
            elif node.op in ("placeholder", "output") or stage[node] != k:
                continue
            else:
                env[node] = graph.node_copy(node, arg)
                emit_stashes(node)

        # 5. output: the next stage's boundary values, or the model's outputs.
        if k == last:
            graph.node_copy(output_node, arg)
            output_names.append(
                [leaf.name if isinstance(leaf, torch.fx.Node) else repr(leaf) for leaf in _leaves(output_node.args[0])]
            )
        else:
            graph.output(tuple(env[v] for v in boundary[k]))
            output_names.append([v.name for v in boundary[k]])

        graph.lint()
        modules.append(StageModule(gm, graph, class_name=f"Stage{k}", stage_index=k))

    return Stages(modules=modules, skip_routes=routes, input_names=input_names, output_names=output_names)
