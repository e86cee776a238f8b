"""Timelines of a distributed run: one lane per rank (Figure 7 of the paper, across processes).

Input: the spans of :func:`fxpipe.distributed.trace.record` (anything with ``kind``,
``rank``, ``stage``, ``microbatch``, ``step``, ``start``, ``end``, ``phase``), all on one
clock. Output: a Chrome trace (one process per rank: its ``pipe.step`` calls on one track,
its forward / backward / weight / loss boxes and the waits on its receives and sends on
another, which never overlap since one thread does them all) and a PNG with one row per rank.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from ._trace import KIND_COLORS

__all__ = ["span_name", "rank_chrome_trace", "save_rank_chrome_trace", "plot_rank_timeline", "RANK_COLORS"]

RANK_COLORS = {"forward": KIND_COLORS["forward"], "backward": KIND_COLORS["backward"], "weight": "#5aa469",
               "loss": "#8c564b", "recv": "#b5b5b5", "send": "#444444"}
_LETTER = {"forward": "F", "backward": "B", "weight": "W", "loss": "L"}
_CARRIES = {"forward": "act", "backward": "grad"}


def span_name(span: Any, several_stages: bool = False) -> str:
    """``F3`` (forward of micro-batch 3), ``B3``, ``W3``, ``L3``, ``recv act 3``, ``send grad 3``;
    ``F3 s2`` when the rank runs several stages (here stage 2)."""
    if span.kind in _LETTER:
        name = f"{_LETTER[span.kind]}{span.microbatch}"
    elif span.kind in ("recv", "send"):
        name = f"{span.kind} {_CARRIES.get(span.phase, '?')} {span.microbatch}"
    else:
        name = span.kind
    return f"{name} s{span.stage}" if several_stages and span.stage >= 0 else name


def _origin(spans: Sequence[Any]) -> float:
    steps = [s.start for s in spans if s.kind == "step"]
    return min(steps or [s.start for s in spans] or [0.0])


def rank_chrome_trace(spans: Sequence[Any], stages: Sequence[Sequence[int]], *, title: str = "fxpipe.distributed",
                      bubbles: Optional[Sequence[float]] = None) -> Dict[str, Any]:
    """``{"traceEvents": [...]}``: pid = rank; tid 0 its steps, tid 1 its work and waits (µs)."""
    t0 = _origin(spans)
    events: List[Dict[str, Any]] = []
    for r, local in enumerate(stages):
        which = ", ".join(map(str, local))
        label = f"rank {r} (stage{'s' if len(local) != 1 else ''} {which})"
        if bubbles is not None and r < len(bubbles):
            label += f", bubble {100 * bubbles[r]:.0f}%"
        events += [{"ph": "M", "pid": r, "tid": 0, "name": "process_name", "args": {"name": label}},
                   {"ph": "M", "pid": r, "tid": 0, "name": "process_sort_index", "args": {"sort_index": r}},
                   {"ph": "M", "pid": r, "tid": 0, "name": "thread_name", "args": {"name": "pipe.step"}},
                   {"ph": "M", "pid": r, "tid": 1, "name": "thread_name", "args": {"name": f"rank {r}"}}]
    for s in spans:
        several = s.rank < len(stages) and len(stages[s.rank]) > 1
        name = f"step {s.step + 1}" if s.kind == "step" else span_name(s, several)
        events.append({"ph": "X", "pid": s.rank, "tid": 0 if s.kind == "step" else 1, "name": name, "cat": s.kind,
                       "ts": round((s.start - t0) * 1e6, 3), "dur": round(max(s.end - s.start, 0.0) * 1e6, 3),
                       "args": {"rank": s.rank, "stage": s.stage, "microbatch": s.microbatch, "step": s.step + 1,
                                "kind": s.kind, "phase": s.phase}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def save_rank_chrome_trace(path: str, spans: Sequence[Any], stages: Sequence[Sequence[int]], *,
                           title: str = "fxpipe.distributed", bubbles: Optional[Sequence[float]] = None) -> int:
    """Writes the Chrome trace; returns the number of events."""
    trace = rank_chrome_trace(spans, stages, title=title, bubbles=bubbles)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])


def plot_rank_timeline(path: str, spans: Sequence[Any], stages: Sequence[Sequence[int]], *, title: str = "",
                       bubbles: Optional[Sequence[float]] = None) -> None:
    """A PNG, one row per rank: F/B/W/L boxes numbered by micro-batch, waits as thin bars."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(stages)
    t0 = _origin(spans)
    ms = 1e3
    t_end = max([(s.end - t0) * ms for s in spans] + [1e-3])
    fig, ax = plt.subplots(figsize=(15.0, 1.4 + 0.8 * n), dpi=110)
    ax.set_xlim(0, t_end * 1.01)
    ax.set_ylim(-0.7, n - 0.3)
    fig.canvas.draw()
    px_per_ms = ax.get_window_extent().width / (t_end * 1.01)
    h = 0.6

    def row(rank: int) -> float:
        return n - 1 - rank  # rank 0 on top

    for s in spans:
        x0, w = (s.start - t0) * ms, max((s.end - s.start) * ms, 0.0)
        y = row(s.rank)
        if s.kind == "step":
            continue
        if s.kind in ("recv", "send"):
            ax.add_patch(plt.Rectangle((x0, y - h / 2 - 0.14), max(w, 0.5 / px_per_ms), 0.1,
                                       color=RANK_COLORS[s.kind], lw=0))
            continue
        ax.add_patch(plt.Rectangle((x0, y - h / 2), w, h, facecolor=RANK_COLORS.get(s.kind, "#999999"),
                                   edgecolor="white", lw=0.6))
        several = len(stages[s.rank]) > 1
        for text in (span_name(s, several), span_name(s), str(s.microbatch)):
            if w * px_per_ms >= 7 * len(text) + 4:
                ax.text(x0 + w / 2, y, text, ha="center", va="center", fontsize=7.5, color="white",
                        fontweight="bold", clip_on=True)
                break
    starts = sorted({s.step: s.start for s in spans if s.kind == "step" and s.rank == 0}.items())
    for i, (step, start) in enumerate(starts):
        x = (start - t0) * ms
        if i:
            ax.axvline(x, color="#777777", ls="--", lw=1)
        if len(starts) > 1:
            ax.text(x + 0.003 * t_end, n - 0.35, f"step {step + 1}", fontsize=8, color="#555555", va="bottom")
    if bubbles is not None:
        for r, b in enumerate(bubbles):
            ax.text(1.005, row(r), f"bubble {100 * b:.0f}%", transform=ax.get_yaxis_transform(),
                    va="center", ha="left", fontsize=9, color="#444444")
    ax.set_yticks([row(r) for r in range(n)])
    ax.set_yticklabels([f"rank {r}\n(stage{'s' if len(st) != 1 else ''} {', '.join(map(str, st))})"
                        for r, st in enumerate(stages)])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#e5e5e5", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in RANK_COLORS if any(s.kind == k for s in spans)]
    labels = {"forward": "forward (F)", "backward": "backward (B)", "weight": "weight grad (W)", "loss": "loss (L)",
              "recv": "waiting to receive", "send": "waiting for a send"}
    ax.legend(handles=[Patch(color=RANK_COLORS[k], label=labels[k]) for k in kinds], ncol=len(kinds) or 1,
              loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title, loc="left", fontsize=11, pad=22)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
