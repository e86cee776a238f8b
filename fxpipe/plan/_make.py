"""From a captured graph to a Plan: profile, build the OpGraph, partition.

Kept apart from ``api.py`` so the CLI can make and print plans without building a pipeline.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import networkx as nx
import torch

from ..checks._batching import Batching
from ..capture._tracing import Capture
from ..errors import BalanceWarning, SplitPointsError
from ._op_graph import build_opgraph
from ..capture._meta import refuse_timing
from ._partition import COMPUTE_OPS, partition
from ._value import Plan, format_cost
from ._profile import NodeCost, count_params_only, profile_graph
from ._recorded import RecordedRun, profile_recorded
from ..progress import ProgressOption, as_progress

__all__ = ["BALANCE_BY", "BalanceWarning", "IMBALANCE_RATIO", "make_plan", "opgraph_for", "split_nodes",
           "imbalance_warning", "profiled_inputs"]

BALANCE_BY = ("time", "memory", "params")
#: the OpGraph attribute each balance mode minimises the largest stage sum of
_COST_ATTR = {"time": "seconds", "memory": "memory", "params": "params"}

#: A plan whose slowest stage costs more than this many times the mean stage, because of one
#: node that alone costs more than the mean, gets a :class:`BalanceWarning`.
IMBALANCE_RATIO = 2.0


#: Assumed inter-GPU bandwidth for the transfer term of stage costs (bytes per second).
GPU_LINK_BYTES_PER_SECOND = 12e9


def seconds_per_byte(devices: Sequence[torch.device]) -> float:
    """Transfers between CPU "devices" cost nothing; between GPUs they take time."""
    if len(set(devices)) <= 1 or all(d.type == "cpu" for d in devices):
        return 0.0
    return 1.0 / GPU_LINK_BYTES_PER_SECOND


def profiled_inputs(captured: Capture, args: tuple, kwargs: dict, balance_by: str, chunks: int = 1,
                    batching: Optional[Batching] = None) -> List[Any]:
    """The graph's flat inputs a plan is profiled on: for ``'time'`` and ``'params'`` one
    micro-batch of the sample (the first of ``chunks``), for ``'memory'`` the whole sample.

    Why a micro-batch: it is what every stage runs, and per-op time does not scale with the
    batch (a weight-bound layer costs nearly as much on a micro-batch as on the whole
    batch), so timing the whole batch misweighs such layers (measured on
    benchmarks/distributed.py's Funnel: 40% more time on its second stage); it is also
    ``chunks`` times cheaper. ``'memory'`` keeps the whole sample: a pipeline holds every
    micro-batch's activations. ``batching`` says which dim each input is split along
    (:class:`~fxpipe.checks._batching.Batching`, checked by the build); without it, dim 0.
    """
    flat = captured.flatten_inputs(args, kwargs)
    if chunks <= 1 or balance_by == "memory":
        return flat
    if batching is None:
        batching = Batching([f"input {i}" for i in range(len(flat))], [0] * len(flat), [], [])
    micro, _ = batching.split(flat, chunks)
    return micro[0]


def opgraph_for(captured: Capture, args: tuple, kwargs: dict, balance_by: str, *, chunks: int = 1,
                batching: Optional[Batching] = None, progress: ProgressOption = False,
                recorded: Optional[RecordedRun] = None) -> nx.DiGraph:
    """The OpGraph with the cost attributes every balance mode reads, profiled on
    :func:`profiled_inputs`: from ``recorded`` (the build check's run) where it ran on them,
    else by running the graph (:mod:`fxpipe.plan._recorded`)."""
    gm = captured.graph_module
    if balance_by == "time" and any(t.is_meta for t in (*gm.parameters(), *gm.buffers())):
        refuse_timing()  # a model built on the meta device: nothing to time
    flat = profiled_inputs(captured, args, kwargs, balance_by, chunks, batching)
    report = as_progress(progress)
    with report.phase("profiling" if balance_by == "time" else "sizing", total=len(gm.graph.nodes)) as step:
        # 'memory' and 'params' need sizes only: one untimed run, deterministic.
        if recorded is not None and (recorded.timed or balance_by != "time") and recorded.ran_on(flat):
            costs = profile_recorded(recorded, on_node=step)
        elif balance_by == "time":
            costs = profile_graph(gm, flat, on_node=step)
        else:
            costs = count_params_only(gm, flat, on_node=step)
    graph = build_opgraph(gm, costs)
    graph.graph["costs"] = cost_summary(costs, gm)
    _fold_parameters(graph)
    for _, data in graph.nodes(data=True):
        # Training memory of a node: its activation, plus the parameter and its gradient.
        data["memory"] = float(data.get("out_bytes") or 0) + 2.0 * float(data.get("params") or 0)
    return graph


def cost_summary(costs: Dict[str, NodeCost], gm: Any) -> Dict[str, Any]:
    """Which node costs were measured and which reused (``{node: node measured}``), for the
    plan: ``{'measured': n, 'reused': m, 'reused_from': {...}}``. Nothing is measured when
    nothing is timed (``'params'``, ``'memory'``): both counts are then 0."""
    compute = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS and n.name in costs]
    reused = {name: costs[name].reused_from for name in compute if costs[name].reused_from}
    timed = any(costs[name].seconds > 0 for name in compute)
    return {"measured": len(compute) - len(reused) if timed else 0, "reused": len(reused), "reused_from": reused}


def _fold_parameters(graph: nx.DiGraph) -> None:
    """Charges each directly read parameter (get_attr) to the first node that reads it.

    get_attr nodes are never cut, so without this a tied or functional weight would weigh
    nothing in ``balance_by='params'``.
    """
    for node, data in graph.nodes(data=True):
        data["params"] = float(data.get("param_bytes") or 0) if data.get("op") in COMPUTE_OPS else 0.0
    for node, data in graph.nodes(data=True):
        if data.get("op") != "get_attr":
            continue
        users = sorted(graph.successors(node), key=lambda n: graph.nodes[n].get("index", 0))
        users = [u for u in users if graph.nodes[u].get("op") in COMPUTE_OPS]
        if users:
            graph.nodes[users[0]]["params"] += float(data.get("param_bytes") or 0)


def split_nodes(captured: Capture, graph: nx.DiGraph, split_points: Sequence[str]) -> List[str]:
    """The first compute node of each qualified module name in ``split_points``."""
    order = sorted(graph.nodes, key=lambda n: graph.nodes[n].get("index", 0))
    found: List[str] = []
    for name in split_points:
        match = None
        for node in order:
            data = graph.nodes[node]
            if data.get("op") not in COMPUTE_OPS:
                continue
            module = str(data.get("module") or "")
            target = str(data.get("target") or "")
            if module == name or module.startswith(name + ".") or (data.get("op") == "call_module" and target == name):
                match = node
                break
        if match is None:
            known = sorted({str(graph.nodes[n].get("module") or "") for n in order} - {""})
            raise SplitPointsError(
                f"split point {name!r} (in split_points) names no module of the traced graph; pass qualified module names "
                f"(model.named_modules()) such as: {', '.join(known[:12])}", argument="split_points"
            )
        found.append(match)
    return found


def make_plan(
    captured: Capture, args: tuple, kwargs: dict, n_stages: int, *,
    balance_by: str = "time", split_points: Optional[Sequence[str]] = None,
    devices: Sequence[torch.device] = (), chunks: int = 1, batching: Optional[Batching] = None,
    progress: ProgressOption = False, recorded: Optional[RecordedRun] = None,
) -> Plan:
    """Profiles (times for ``'time'``, sizes otherwise) on :func:`profiled_inputs`, partitions
    and describes the stages. ``progress``: see :mod:`fxpipe.progress`."""
    report = as_progress(progress)
    graph = opgraph_for(captured, args, kwargs, balance_by, chunks=chunks, batching=batching, progress=report,
                        recorded=recorded)
    cost_attr = _COST_ATTR[balance_by]
    spb = seconds_per_byte(devices) if balance_by == "time" else 0.0
    split_before = split_nodes(captured, graph, split_points) if split_points else None
    if split_before is not None and len(split_before) != n_stages - 1:
        raise SplitPointsError(
            f"split_points has {len(split_before)} names but n_stages={n_stages} needs {n_stages - 1}; pass "
            f"{n_stages - 1} module names (a stage starts at each), or n_stages={len(split_before) + 1}",
            argument="split_points")
    try:
        with report.phase("partitioning"):
            assignment = partition(graph, n_stages, cost_attr=cost_attr, seconds_per_byte=spb, split_before=split_before)
    except SplitPointsError as e:  # partition speaks of nodes; the user gave module names
        where = ", ".join(f"{m!r} at node {n!r}" for m, n in zip(split_points or (), split_before or ()))
        raise SplitPointsError(f"split_points ({where}) cannot cut the graph: {e}", argument="split_points") from e
    meta: Dict[str, Any] = {
        "model": type(captured.graph_module).__name__,
        "capture": captured.method,
        "nodes": graph.number_of_nodes(),
        "cost_attr": cost_attr,
        "seconds_per_byte": spb,
        "chunks": chunks,
        "costs": graph.graph["costs"],
    }
    plan = Plan.from_assignment(graph, assignment, balance_by=balance_by, cost_attr=cost_attr,
                                seconds_per_byte=spb, meta=meta)
    if split_before is None:  # with split_points the user chose the cuts
        message = imbalance_warning(captured, graph, plan, cost_attr)
        if message:
            plan.meta["warnings"] = [message]  # printed by Plan.__str__, saved with the plan
            warnings.warn(f"fxpipe: {message}", BalanceWarning, stacklevel=3)
    return plan


def imbalance_warning(captured: Capture, graph: nx.DiGraph, plan: Plan, cost_attr: str) -> str:
    """Why the slowest stage is far above the mean because of one unsplittable node, or ''.

    Fires when the slowest stage costs more than :data:`IMBALANCE_RATIO` times the mean and
    its most expensive node alone costs more than the mean: no cut can fix that, the node
    itself must become splittable (or the pipeline shorter).
    """
    costs = [st.cost for st in plan.stages]
    if len(costs) < 2 or sum(costs) <= 0:
        return ""
    mean = sum(costs) / len(costs)
    worst = max(range(len(costs)), key=costs.__getitem__)
    if costs[worst] <= IMBALANCE_RATIO * mean:
        return ""
    nodes = [n for n in plan.stages[worst].nodes if n in graph.nodes and graph.nodes[n].get("op") in COMPUTE_OPS]
    if plan.balance_by == "time":
        # Measured times of tiny operations are noisy enough to single one out by chance:
        # report only modules kept opaque, whose cost is real and which the user can change.
        nodes = [n for n in nodes if _opaque_module(captured, graph, n)]
    if not nodes:
        return ""
    big = max(nodes, key=lambda n: float(graph.nodes[n].get(cost_attr) or 0.0))
    big_cost = float(graph.nodes[big].get(cost_attr) or 0.0)
    if big_cost <= mean:
        return ""
    what, todo = _describe_opaque(captured, graph, big)
    fmt = lambda c: format_cost(c, plan.balance_by)  # noqa: E731
    return (f"stage {worst} costs {fmt(costs[worst])}, {costs[worst] / mean:.1f}x the mean stage ({fmt(mean)}), "
            f"because of one node fxpipe cannot split: {what}, {fmt(big_cost)} on its own. {todo}")


def _opaque_module(captured: Capture, graph: nx.DiGraph, name: str) -> bool:
    """A call_module node of a module kept opaque automatically or by ``leaf_modules``."""
    data = graph.nodes[name]
    return data.get("op") == "call_module" and str(data.get("target")) in captured.leaves


def _describe_opaque(captured: Capture, graph: nx.DiGraph, name: str) -> tuple[str, str]:
    """(what the node is, what to do) for :func:`imbalance_warning`."""
    data = graph.nodes[name]
    gm = captured.graph_module
    fx_node = next((n for n in gm.graph.nodes if n.name == name), None)
    if data.get("op") == "call_module":
        target = str(data.get("target"))
        try:
            cls = type(gm.get_submodule(target))
            kind = f"{cls.__module__}.{cls.__qualname__}"
        except AttributeError:
            kind = "module"
        auto = fx_node.meta.get("fxpipe_auto_leaf") if fx_node is not None else None
        if auto:
            todo = fx_node.meta.get("fxpipe_auto_leaf_todo") if fx_node is not None else None
            return (f"the opaque module '{target}' ({kind}; {auto})",
                    todo or f"To split it, make '{target}' traceable by torch.fx (for transformers models a config "
                    "change such as use_cache=False often does it), or move the untraceable lines into a small "
                    "submodule of their own: fxpipe then keeps only that one opaque and cuts the rest.")
        if target in captured.leaves:
            return (f"the module '{target}' ({kind}), kept opaque by leaf_modules or for its hooks",
                    f"Remove '{target}' from leaf_modules (or list some of its submodules instead), or move its "
                    "hooks to an enclosing module, so fxpipe can cut inside it.")
        return (f"the torch.nn layer '{target}' ({kind}), which fxpipe keeps whole",
                "Use fewer stages, or build that part of the model from smaller layers.")
    module = str(data.get("module") or "")
    where = f" in '{module}'" if module else ""
    return (f"the single operation '{name}' ({data.get('target')}){where}",
            "One operation cannot be split: use fewer stages.")
