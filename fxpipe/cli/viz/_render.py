"""Draw a Plan over its OpGraph with graphviz: which stage holds what, and what crosses.

One cluster per stage (colour per stage, labelled with its cost and parameters), nodes
labelled with the original qualified names and output shapes, boundary edges labelled with
the bytes sent, portal edges (values that skip stages) dashed red, and a legend. Large
graphs can be collapsed by module depth (``depth=1``: one node per top-level submodule;
a module whose nodes span stages is drawn once per stage).
"""

from __future__ import annotations

import html
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import networkx as nx

from ...plan._op_graph import collapse_by_depth
from ...plan._value import Plan, format_cost, human_bytes

__all__ = ["render_plan", "save_graph", "stage_colors", "INSTALL_HINT"]

INSTALL_HINT = ("install graphviz to render it: apt-get install graphviz (Debian/Ubuntu), "
                "brew install graphviz (macOS), conda install graphviz")

# ColorBrewer "Paired": (light, dark) per stage; then Set3-ish extras.
_PALETTE = [
    ("#a6cee3", "#1f78b4"), ("#b2df8a", "#33a02c"), ("#fdbf6f", "#ff7f00"), ("#cab2d6", "#6a3d9a"),
    ("#fb9a99", "#e31a1c"), ("#ffff99", "#b15928"), ("#8dd3c7", "#1b7f73"), ("#d9d9d9", "#525252"),
]
PORTAL_COLOR = "#d62728"


def stage_colors(k: int) -> Tuple[str, str, str]:
    """(fill, border, background) colours of stage ``k``."""
    light, dark = _PALETTE[k % len(_PALETTE)]
    return light, dark, _blend(light, 0.35)


def _blend(color: str, amount: float) -> str:
    """Mix ``color`` with white: ``amount=1`` keeps the colour, 0 gives white."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    mix = [round(255 - (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _stage_summary(st: Any, balance_by: str) -> str:
    if balance_by == "params":
        return f"params {human_bytes(st.param_bytes)}"
    what = "time" if balance_by == "time" else balance_by
    return f"{what} {format_cost(st.cost, balance_by)} · params {human_bytes(st.param_bytes)}"


def _short_target(target: str) -> str:
    for prefix in ("torch.nn.functional.", "torch._C._nn.", "torch.ops.aten.", "operator.", "builtins.",
                   "_operator."):
        if target.startswith(prefix):
            short = target[len(prefix):]
            return ("F." + short) if prefix == "torch.nn.functional." else short
    return target


@dataclass
class _Drawn:
    """One box of the drawing: an fx node, or the members of a module group in one stage."""

    key: str
    stage: int
    members: List[str] = field(default_factory=list)
    group: str = ""
    part: Tuple[int, int] = ()  # type: ignore[assignment]  # (i, n) when a group spans n stages


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _node_label(g: nx.DiGraph, d: _Drawn, gm: Any) -> Tuple[str, Dict[str, str]]:
    """HTML label and node attributes."""
    small = '<FONT POINT-SIZE="9" COLOR="#333333">{}</FONT>'
    if d.group and not (len(d.members) == 1 and g.nodes[d.members[0]].get("op") == "call_module"):
        last = max(d.members, key=lambda n: g.nodes[n].get("index", 0))
        params = sum(int(g.nodes[n].get("param_bytes") or 0) for n in d.members)
        part = f" (part {d.part[0]}/{d.part[1]})" if d.part else ""
        ops = f"{len(d.members)} op" + ("s" if len(d.members) != 1 else "")
        lines = [f"<B>{_esc(d.group)}</B>{_esc(part)}",
                 small.format(_esc(f"{ops} · params {human_bytes(params)}")),
                 small.format(_esc(f"out {g.nodes[last].get('shape') or '?'}"))]
        return "<" + "<BR/>".join(lines) + ">", {"shape": "box3d"}
    data = g.nodes[d.members[0]]
    op, target, module = data.get("op"), str(data.get("target") or ""), str(data.get("module") or "")
    shape = data.get("shape") or ""
    attrs: Dict[str, str] = {"shape": "box", "style": "rounded,filled"}
    if op == "placeholder":
        title, sub = f"input {target}", shape
        attrs = {"shape": "cds", "style": "filled"}
    elif op == "output":
        title, sub = "output", ""
        attrs = {"shape": "doublecircle", "style": "filled", "width": "0.3"}
    elif op == "get_attr":
        title, sub = target, f"parameter · {shape}" if shape else "parameter"
        attrs = {"shape": "note", "style": "filled"}
    elif op == "call_module":
        kind = ""
        if gm is not None:
            try:
                kind = type(gm.get_submodule(target)).__name__
            except AttributeError:
                kind = ""
        title = target
        sub = " · ".join(x for x in (kind, shape) if x)
    else:  # call_function / call_method
        fn = _short_target(target)
        if op == "call_method":
            fn = "." + fn + "()"
        title = f"{module}: {fn}" if module else fn
        sub = shape
        attrs = {"shape": "box", "style": "filled"}
    label = f"<B>{_esc(title)}</B>" + (f"<BR/>{small.format(_esc(sub))}" if sub else "")
    return "<" + label + ">", attrs


def _drawn_nodes(g: nx.DiGraph, plan: Plan, depth: Optional[int]) -> Tuple[Dict[str, str], Dict[str, _Drawn]]:
    """Maps each OpGraph node to the key of its box; the boxes."""
    group_of = {n: "" for n in g.nodes}
    if depth:
        collapsed = collapse_by_depth(g, depth)
        for key, data in collapsed.nodes(data=True):
            if data.get("op") == "group":
                for m in data.get("members", ()):
                    group_of[m] = str(data.get("module") or key)
    stages_of_group: Dict[str, set] = {}
    for n, grp in group_of.items():
        if grp:
            stages_of_group.setdefault(grp, set()).add(plan.stage_of(n))
    box_of: Dict[str, str] = {}
    boxes: Dict[str, _Drawn] = {}
    for n in sorted(g.nodes, key=lambda n: g.nodes[n].get("index", 0)):
        stage = plan.stage_of(n)
        grp = group_of[n]
        if grp:
            key = f"group__{grp}" + (f"__stage{stage}" if len(stages_of_group[grp]) > 1 else "")
        else:
            key = f"node__{n}"
        box = boxes.setdefault(key, _Drawn(key, stage, group=grp))
        box.members.append(n)
        box_of[n] = key
    for box in boxes.values():
        if box.group and len(stages_of_group[box.group]) > 1:
            order = sorted(stages_of_group[box.group])
            box.part = (order.index(box.stage) + 1, len(order))
    return box_of, boxes


LAYOUTS = ("columns", "lr", "tb")


def render_plan(g: nx.DiGraph, plan: Plan, *, gm: Any = None, depth: Optional[int] = None,
                layout: str = "columns", title: str = "") -> Any:
    """The staged graph as a ``graphviz.Digraph``.

    ``g`` is the OpGraph the plan was made from (``fxpipe.plan._make.opgraph_for``), ``gm``
    the captured GraphModule (optional: names the module types), ``depth`` collapses
    nodes by module depth. ``layout``: ``'columns'`` (stages side by side, each read top
    down: compact for long chains), ``'lr'`` or ``'tb'`` (one chain left-right / top-down).
    """
    import graphviz

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    columns = layout == "columns"
    box_of, boxes = _drawn_nodes(g, plan, depth)
    dot = graphviz.Digraph("fxpipe", graph_attr={
        "rankdir": "LR" if layout == "lr" else "TB", "fontname": "Helvetica", "newrank": "true", "compound": "true",
        "nodesep": "0.25", "ranksep": "0.35", "splines": "spline", "bgcolor": "white",
        "labelloc": "t", "labeljust": "l", "pad": "0.3",
    }, node_attr={"fontname": "Helvetica", "fontsize": "11", "margin": "0.12,0.05", "penwidth": "1.4"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9", "arrowsize": "0.7"})
    dot.attr(label=_legend(plan, title), labelloc="t", labeljust="l")

    for st in plan.stages:
        fill, border, background = stage_colors(st.index)
        with dot.subgraph(name=f"cluster_stage{st.index}") as c:
            c.attr(label=(f"<<B>stage {st.index}</B><BR/><FONT POINT-SIZE=\"10\">"
                          f"{_esc(_stage_summary(st, plan.balance_by))}"
                          "</FONT>>"),
                   style="filled,rounded", fillcolor=background, color=border, penwidth="2",
                   fontsize="13", fontcolor=border, labeljust="c")
            for key, box in boxes.items():
                if box.stage != st.index:
                    continue
                label, attrs = _node_label(g, box, gm)
                style = attrs.pop("style", "filled")
                c.node(key, label=label, fillcolor=fill, color=border, style=style, **attrs)

    # edges between boxes; a value crossing into a box counts once per destination box
    crossing: Dict[Tuple[str, str], Dict[str, int]] = {}
    for u, v, data in g.edges(data=True):
        bu, bv = box_of[u], box_of[v]
        if bu != bv:
            crossing.setdefault((bu, bv), {})[u] = int(data.get("bytes") or 0)
    labelled: set = set()
    for (bu, bv), sources in sorted(crossing.items(), key=lambda kv: (g.nodes[boxes[kv[0][0]].members[0]]["index"],
                                                                       g.nodes[boxes[kv[0][1]].members[0]]["index"])):
        su, sv = boxes[bu].stage, boxes[bv].stage
        size = sum(sources.values())
        if su == sv:
            dot.edge(bu, bv, color="#555555")
        elif sv == su + 1:
            _, border, _ = stage_colors(su)
            # in columns, each stage restarts at the top: cross-stage edges must not rank
            dot.edge(bu, bv, label=human_bytes(size), color=border, fontcolor=border, penwidth="2.2",
                     constraint="false" if columns else "true")
        else:
            # one label per (value, destination stage): a portal carries a value once per stage
            first = (tuple(sorted(sources)), sv) not in labelled
            labelled.add((tuple(sorted(sources)), sv))
            dot.edge(bu, bv, label=f"portal {su}→{sv}\n{human_bytes(size)}" if first else "",
                     color=PORTAL_COLOR, fontcolor=PORTAL_COLOR, style="dashed", penwidth="2.2",
                     constraint="false")
    if columns:  # an invisible root above the first box of every stage keeps the stages in order
        dot.node("stage_order_root", label="", style="invis", shape="point", width="0", height="0",
                 ordering="out")
        for st in plan.stages:
            keys = [k for k, b in boxes.items() if b.stage == st.index]
            if keys:
                dot.edge("stage_order_root", keys[0], style="invis")
    return dot


def _legend(plan: Plan, title: str = "") -> str:
    rows = [f'<TR><TD COLSPAN="6" ALIGN="LEFT"><FONT POINT-SIZE="16"><B>{_esc(title)}</B></FONT></TD></TR>'] if title else []
    rows += [
            '<TR><TD></TD><TD ALIGN="LEFT"><B>stage</B></TD><TD ALIGN="RIGHT"><B>cost</B></TD>'
            '<TD ALIGN="RIGHT"><B>params</B></TD><TD ALIGN="RIGHT"><B>in</B></TD><TD ALIGN="RIGHT"><B>out</B></TD></TR>']
    for st in plan.stages:
        fill, border, _ = stage_colors(st.index)
        rows.append(
            f'<TR><TD BGCOLOR="{fill}" WIDTH="18"> </TD><TD ALIGN="LEFT">stage {st.index} ({len(st.nodes)} node{"s" if len(st.nodes) != 1 else ""})</TD>'
            f'<TD ALIGN="RIGHT">{_esc(format_cost(st.cost, plan.balance_by))}</TD>'
            f'<TD ALIGN="RIGHT">{_esc(human_bytes(st.param_bytes))}</TD>'
            f'<TD ALIGN="RIGHT">{_esc(human_bytes(st.act_in_bytes))}</TD>'
            f'<TD ALIGN="RIGHT">{_esc(human_bytes(st.act_out_bytes))}</TD></TR>')
    rows.append('<TR><TD COLSPAN="6" ALIGN="LEFT"><FONT COLOR="#1f78b4"><B>━━▶</B></FONT> boundary edge '
                '(to the next stage; activation bytes)</TD></TR>')
    rows.append(f'<TR><TD COLSPAN="6" ALIGN="LEFT"><FONT COLOR="{PORTAL_COLOR}"><B>╍╍▶</B></FONT> portal '
                '(skips stages, sent straight to the consumer)</TD></TR>')
    return ('<<TABLE BORDER="1" COLOR="#999999" CELLBORDER="0" CELLSPACING="2" CELLPADDING="3" BGCOLOR="white">'
            + "".join(rows) + "</TABLE>>")


def save_graph(dot: Any, path: str) -> Tuple[str, str]:
    """Writes ``dot`` to ``path`` in the format its suffix names (svg, png, pdf, dot/gv).

    Returns ``(written path, note)``. Without the graphviz ``dot`` binary the DOT source is
    written instead (``path`` with suffix ``.dot``) and ``note`` says how to install it.
    """
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix in ("dot", "gv"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(dot.source)
        return path, ""
    if suffix not in ("svg", "png", "pdf", "jpg", "jpeg"):
        raise ValueError(f"unknown output format {suffix or '(none)'!r} for {path}: use .svg, .png, .pdf or .dot")
    if shutil.which("dot") is None:
        fallback = os.path.splitext(path)[0] + ".dot"
        with open(fallback, "w", encoding="utf-8") as f:
            f.write(dot.source)
        return fallback, (f"graphviz 'dot' was not found, so {path} was not drawn; wrote the DOT source to "
                          f"{fallback} instead. To draw it, {INSTALL_HINT}; then run: dot -T{suffix} {fallback} -o {path}")
    data = dot.pipe(format="jpg" if suffix == "jpeg" else suffix)
    with open(path, "wb") as f:
        f.write(data)
    return path, ""
