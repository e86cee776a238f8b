"""fxpipe.cli.viz: graphviz rendering of plans, Chrome traces and PNG timelines (in-process, fast)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.capture._tracing import capture
from fxpipe.plan._make import make_plan, opgraph_for
from fxpipe.runtime._timeline import Recorder, Span
from fxpipe.cli.viz import chrome_trace, lanes, plot_timeline, render_plan, save_chrome_trace, save_graph

HAVE_DOT = shutil.which("dot") is not None
SVG = "{http://www.w3.org/2000/svg}"


class Skippy(nn.Module):
    """A long skip: with 3 stages, ``h`` goes from stage 0 straight to stage 2 (a portal)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        return self.d(torch.cat([self.c(self.b(h)), h], 1))


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model, x = Skippy(), torch.randn(8, 8)
    cap = capture(model, (x,), {})
    plan = make_plan(cap, (x,), {}, 3, balance_by="params")
    graph = opgraph_for(cap, (x,), {}, "params")
    return cap, plan, graph


def _clusters(svg: bytes) -> list:
    root = ET.fromstring(svg)
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"]


@pytest.mark.skipif(not HAVE_DOT, reason="graphviz dot binary not installed")
@pytest.mark.parametrize("layout", ["columns", "lr"])
def test_render_one_cluster_per_stage(planned, layout):
    cap, plan, graph = planned
    assert plan.portals, "the test model must produce a portal"
    dot = render_plan(graph, plan, gm=cap.graph_module, layout=layout, title="Skippy")
    clusters = _clusters(dot.pipe(format="svg"))
    assert len(clusters) == plan.n_stages
    titles = [c.find(f"{SVG}title").text for c in clusters]
    assert titles == [f"cluster_stage{k}" for k in range(plan.n_stages)]


def test_render_labels_portals_and_boundaries(planned):
    cap, plan, graph = planned
    src = render_plan(graph, plan, gm=cap.graph_module).source
    assert "Linear" in src and "8x16" in src  # module types and output shapes
    assert "portal" in src and "dashed" in src
    portal = plan.portals[0]
    assert f"portal {portal.src}→{portal.dst}" in src
    assert "stage 0" in src and "boundary edge" in src  # the legend


def test_render_depth_splits_groups_across_stages(planned):
    cap, plan, graph = planned
    src = render_plan(graph, plan, depth=1).source
    stages_of_b = {plan.stage_of(n) for n, d in graph.nodes(data=True) if str(d.get("module", "")).startswith("b.")}
    if len(stages_of_b) > 1:
        assert "(part 1/" in src
    else:
        assert "group__b" in src
    assert "node__b_0" not in src  # b's members are merged


def test_save_graph_without_dot_writes_dot_file(planned, tmp_path, monkeypatch):
    cap, plan, graph = planned
    dot = render_plan(graph, plan)
    monkeypatch.setattr("fxpipe.cli.viz._render.shutil.which", lambda name: None)
    written, note = save_graph(dot, str(tmp_path / "g.svg"))
    assert written.endswith("g.dot") and (tmp_path / "g.dot").read_text().startswith("digraph")
    assert not (tmp_path / "g.svg").exists()
    assert "apt-get install graphviz" in note and "brew install graphviz" in note


def test_save_graph_dot_suffix_needs_no_binary(planned, tmp_path, monkeypatch):
    cap, plan, graph = planned
    monkeypatch.setattr("fxpipe.cli.viz._render.shutil.which", lambda name: None)
    written, note = save_graph(render_plan(graph, plan), str(tmp_path / "g.dot"))
    assert note == "" and "cluster_stage0" in (tmp_path / "g.dot").read_text()


# -- timelines -------------------------------------------------------------------------------
def _span(kind, p, m, a, b):
    return Span(kind, p, m, "cpu", a, b, "t")


def test_backward_clipped_to_lane_and_recompute_nested():
    spans = [
        _span("forward", 0, 0, 0.0, 1.0),
        _span("backward", 0, 1, 2.0, 4.0),
        _span("backward", 0, 0, 2.5, 6.0),  # gradient arrived while the lane was busy
        _span("recompute", 0, 0, 4.2, 4.5),
        _span("copy", 1, 0, 1.0, 1.1),
    ]
    boxes = {(b.kind, b.microbatch): b for b in lanes(spans)}
    assert boxes[("backward", 0)].start == pytest.approx(4.0)
    trace = chrome_trace(spans, ["cpu"])
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    b0 = next(e for e in x if e["name"] == "B0")
    r0 = next(e for e in x if e["name"] == "R0")
    assert b0["ts"] <= r0["ts"] and r0["ts"] + r0["dur"] <= b0["ts"] + b0["dur"]
    assert r0["tid"] == b0["tid"]
    copy = next(e for e in x if e["name"] == "copy")
    assert copy["tid"] != b0["tid"]


def test_recompute_before_clip_moves_backward_start():
    spans = [_span("backward", 0, 1, 0.0, 4.0), _span("backward", 0, 0, 1.0, 6.0),
             _span("recompute", 0, 0, 3.0, 3.5)]
    b0 = next(b for b in lanes(spans) if b.kind == "backward" and b.microbatch == 0)
    assert b0.start == pytest.approx(3.0)


def _validate(trace: dict) -> list:
    assert isinstance(trace["traceEvents"], list)
    xs = []
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            for key in ("ph", "ts", "dur", "pid", "tid", "name"):
                assert key in e
            assert e["dur"] >= 0 and e["ts"] >= 0
            xs.append(e)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "stage 0 (cpu)" in names
    return xs


def test_recorded_pipeline_trace_and_png(tmp_path):
    torch.manual_seed(0)
    model, x = Skippy(), torch.randn(8, 8)
    n, chunks, steps = 3, 2, 2
    pipe = fxpipe.pipeline(model, x, n, chunks=chunks, devices=["cpu"] * n, balance_by="params")
    pipe(x).sum().backward()  # warm-up
    rec, marks = Recorder(), []
    with rec:
        for _ in range(steps):
            t = __import__("time").perf_counter()
            pipe(x).sum().backward()
            marks.append((t, __import__("time").perf_counter()))
    path = tmp_path / "t.json"
    save_chrome_trace(str(path), rec.spans, ["cpu"] * n, steps=marks, title="Skippy")
    xs = _validate(json.loads(path.read_text()))
    forwards = [e for e in xs if e["cat"] == "forward"]
    assert len(forwards) == n * chunks * steps
    assert {e["args"]["step"] for e in forwards} == {1, 2}
    assert {e["name"] for e in forwards} == {f"F{m}" for m in range(chunks)}
    assert all(set(e["args"]) >= {"stage", "microbatch", "kind"} for e in xs if e["cat"] != "step")
    png = tmp_path / "t.png"
    plot_timeline(str(png), rec.spans, ["cpu"] * n, steps=marks, title="Skippy")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_trace():
    assert [e for e in chrome_trace([], ["cpu"])["traceEvents"] if e["ph"] == "X"] == []
