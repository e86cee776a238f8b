"""Timelines of recorded pipeline runs: Chrome-trace JSON and a matplotlib PNG.

Input: the :class:`~fxpipe.runtime._timeline.Span` list of a ``Recorder``. Output: one
lane per stage (even when every stage shares one CPU: the pipeline shape is what matters),
plus a lane per stage for the copies into it. Like Figure 7 of the torchgpipe paper:
forward, backward and recompute boxes numbered by micro-batch; idle gaps are the bubble.

A backward span is recorded from the moment its output gradient arrives, but its work
starts only when the stage is free: where it overlaps the previous span of its lane its
start is clipped to that span's end.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Box", "lanes", "chrome_trace", "save_chrome_trace", "plot_timeline", "have_matplotlib", "PLOT_INSTALL",
           "png_skipped", "KIND_COLORS", "KIND_LETTER"]

KIND_LETTER = {"forward": "F", "backward": "B", "recompute": "R", "copy": "copy"}
KIND_COLORS = {"forward": "#4e8fd6", "backward": "#f0a043", "recompute": "#9b6fc3", "copy": "#d62728"}
_KIND_ORDER = ("forward", "backward", "recompute", "copy")


@dataclass
class Box:
    """One drawn span: seconds relative to the first recorded step."""

    kind: str
    stage: int
    microbatch: int
    device: str
    start: float
    end: float
    step: int = 0

    @property
    def name(self) -> str:
        letter = KIND_LETTER.get(self.kind, self.kind)
        return letter if self.kind == "copy" else f"{letter}{self.microbatch}"


def lanes(spans: Sequence[Any], steps: Optional[Sequence[Tuple[float, float]]] = None) -> List[Box]:
    """Spans -> boxes relative to the start, with backward starts clipped per stage lane."""
    if not spans:
        return []
    t0 = steps[0][0] if steps else min(s.start for s in spans)
    starts = [a for a, _ in steps] if steps else [t0]

    def step_of(t: float) -> int:
        return max(0, bisect.bisect_right(starts, t) - 1)

    boxes = [Box(s.kind, int(s.partition), int(s.microbatch), str(s.device), s.start - t0, s.end - t0,
                 step_of(s.start)) for s in spans]
    by_stage: Dict[int, List[Box]] = {}
    for b in boxes:
        if b.kind in ("forward", "backward"):
            by_stage.setdefault(b.stage, []).append(b)
    recomputes = {(b.stage, b.microbatch, b.step): b for b in boxes if b.kind == "recompute"}
    for lane in by_stage.values():
        lane.sort(key=lambda b: (b.start, b.end))
        prev_end = float("-inf")
        for b in lane:
            if b.kind == "backward" and b.start < prev_end < b.end:
                b.start = prev_end
            if b.kind == "backward":  # its recompute is part of its work: it never starts later
                r = recomputes.get((b.stage, b.microbatch, b.step))
                if r is not None and r.start < b.start:
                    b.start = r.start
            prev_end = max(prev_end, b.end)
    boxes.sort(key=lambda b: (b.start, b.stage))
    return boxes


def _lane_tids(n_stages: int) -> Tuple[Dict[int, int], Dict[int, int]]:
    return ({k: 1 + 2 * k for k in range(n_stages)}, {k: 2 + 2 * k for k in range(n_stages)})


def chrome_trace(spans: Sequence[Any], devices: Sequence[str], *,
                 steps: Optional[Sequence[Tuple[float, float]]] = None, title: str = "fxpipe") -> Dict[str, Any]:
    """``{"traceEvents": [...]}``: complete events (``ph: "X"``, µs) and lane names."""
    boxes = lanes(spans, steps)
    n_stages = max([len(devices)] + [b.stage + 1 for b in boxes])
    compute_tid, copy_tid = _lane_tids(n_stages)
    pid = 1
    events: List[Dict[str, Any]] = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": title}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "steps"}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "thread_sort_index", "args": {"sort_index": 0}},
    ]
    for k in range(n_stages):
        dev = devices[k] if k < len(devices) else "?"
        for tid, label in ((compute_tid[k], f"stage {k} ({dev})"), (copy_tid[k], f"copies to stage {k}")):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": label}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    t0 = steps[0][0] if steps else (min(s.start for s in spans) if spans else 0.0)
    for i, (a, b) in enumerate(steps or ()):
        events.append({"ph": "X", "pid": pid, "tid": 0, "name": f"step {i + 1}", "cat": "step",
                       "ts": round((a - t0) * 1e6, 3), "dur": round((b - a) * 1e6, 3), "args": {"step": i + 1}})
    for b in boxes:
        tid = copy_tid[b.stage] if b.kind == "copy" else compute_tid[b.stage]
        events.append({"ph": "X", "pid": pid, "tid": tid, "name": b.name, "cat": b.kind,
                       "ts": round(b.start * 1e6, 3), "dur": round(max(b.end - b.start, 0.0) * 1e6, 3),
                       "args": {"stage": b.stage, "microbatch": b.microbatch, "kind": b.kind,
                                "device": b.device, "step": b.step + 1}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def save_chrome_trace(path: str, spans: Sequence[Any], devices: Sequence[str], *,
                      steps: Optional[Sequence[Tuple[float, float]]] = None, title: str = "fxpipe") -> int:
    """Writes the Chrome trace; returns the number of events."""
    trace = chrome_trace(spans, devices, steps=steps, title=title)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])


#: the command that installs what PNG timelines need: fxpipe's ``plot`` extra (matplotlib)
PLOT_INSTALL = "pip install 'fxpipe[plot]'"


def have_matplotlib() -> bool:
    """PNG timelines need matplotlib (the ``plot`` extra, not a dependency: fxpipe runs without
    it); without it the commands write the JSON only and say how to get the PNG."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_skipped(png: str) -> str:
    """The line ``fxpipe timeline`` (one process or ``--nproc``) prints for a PNG it could not write."""
    return f"not written: {png} (matplotlib is not installed: {PLOT_INSTALL})"


def plot_timeline(path: str, spans: Sequence[Any], devices: Sequence[str], *,
                  steps: Optional[Sequence[Tuple[float, float]]] = None, title: str = "") -> None:
    """A PNG with one row per stage: F/R/B boxes numbered by micro-batch, copies in red."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    boxes = lanes(spans, steps)
    n_stages = max([len(devices)] + [b.stage + 1 for b in boxes])
    t_end = max([b.end for b in boxes] + [(s[1] - steps[0][0]) for s in (steps or ())] + [1e-6])
    ms = 1e3
    fig_w = 15.0
    fig, ax = plt.subplots(figsize=(fig_w, 1.3 + 0.72 * n_stages), dpi=110)
    ax.set_xlim(0, t_end * ms * 1.01)
    ax.set_ylim(-0.6, n_stages - 0.4)
    fig.canvas.draw()
    px_per_ms = ax.get_window_extent().width / (t_end * ms * 1.01)

    def row(stage: int) -> float:
        return n_stages - 1 - stage  # stage 0 on top

    h = 0.62
    # a backward box's label goes after its recompute, which is drawn over its first part
    rec_end = {(b.stage, b.microbatch, b.step): b.end * ms for b in boxes if b.kind == "recompute"}
    for kind in _KIND_ORDER:  # recompute over backward: it is the first part of that work
        for b in (x for x in boxes if x.kind == kind):
            x0, w = b.start * ms, max((b.end - b.start) * ms, 0.0)
            y = row(b.stage)
            if kind == "copy":
                ax.add_patch(plt.Rectangle((x0, y - h / 2 - 0.11), max(w, 0.5 / px_per_ms), 0.08,
                                           color=KIND_COLORS["copy"], lw=0))
                continue
            ax.add_patch(plt.Rectangle((x0, y - h / 2), w, h, facecolor=KIND_COLORS[kind],
                                       edgecolor="white", lw=0.6))
            lx0 = x0
            if kind == "backward":
                lx0 = min(max(x0, rec_end.get((b.stage, b.microbatch, b.step), x0)), x0 + w)
            lw = x0 + w - lx0
            if lw * px_per_ms >= 9:
                text = f"{KIND_LETTER[kind]}{b.microbatch}" if lw * px_per_ms >= 20 else str(b.microbatch)
                ax.text(lx0 + lw / 2, y, text, ha="center", va="center", fontsize=7.5, color="white",
                        fontweight="bold", clip_on=True)
    # busy share per stage (forward + backward lanes, merged)
    for k in range(n_stages):
        ivs = sorted((b.start, b.end) for b in boxes if b.stage == k and b.kind in ("forward", "backward", "recompute"))
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in ivs:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        ax.text(1.005, row(k), f"busy {100 * busy / t_end:.0f}%", transform=ax.get_yaxis_transform(),
                va="center", ha="left", fontsize=9, color="#444444")
    for i, (a, b) in enumerate(steps or ()):
        x = (a - steps[0][0]) * ms
        if i:
            ax.axvline(x, color="#777777", ls="--", lw=1)
        if len(steps) > 1:
            ax.text(x + 0.003 * t_end * ms, n_stages - 0.45, f"step {i + 1}", fontsize=8, color="#555555",
                    va="bottom", ha="left")
    ax.set_yticks([row(k) for k in range(n_stages)])
    ax.set_yticklabels([f"stage {k}\n({devices[k] if k < len(devices) else '?'})" for k in range(n_stages)])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#e5e5e5", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=KIND_COLORS[k], label=label) for k, label in
               (("forward", "forward (F)"), ("recompute", "recompute (R)"), ("backward", "backward (B)"),
                ("copy", "copy"))]
    ax.legend(handles=handles, ncol=4, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title, loc="left", fontsize=11, pad=22 if n_stages < 3 else 18)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
