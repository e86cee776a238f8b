"""The report of ``benchmarks/distributed.py``: every rank's raw measurements turned into
medians, ratios against the peer, bubble fractions and memory per rank, and a markdown table."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Tuple

from fxpipe.distributed.trace import Span, bubble_fractions

__all__ = ["summarise", "table"]


def _q(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _busy_per_step(spans: List[List[Any]]) -> float:
    """Median seconds of compute spans inside each ``step`` span of one rank (BusyRecorder's
    spans do not nest): set against ``chunks x`` the stage alone, it shows how much slower
    the stages ran inside the pipeline's steps (other processes, the other ranks)."""
    steps = [(a, b) for kind, a, b in spans if kind == "step"]
    return statistics.median(sum(min(b, e) - max(a, s) for kind, a, b in spans if kind != "step" and b > s and a < e)
                             for s, e in steps)


def summarise(ranks: List[Dict[str, Any]], goals: Dict[str, Tuple[str, float]]) -> Dict[str, Any]:
    """Per run and contender: step time (slowest rank per repetition) median and quartiles,
    the ratio to the peer (of medians, and the median of the paired per-repetition ratios),
    bubble fraction (fxpipe.distributed.trace's definition, from both recorders' spans) and
    memory per rank."""
    runs: Dict[str, Any] = {}
    for key, run0 in ranks[0]["runs"].items():
        scenario = key.split("/")[0]
        names = list(run0["times"])
        steps = {n: [max(r["runs"][key]["times"][n][i] for r in ranks) for i in range(len(run0["times"][n]))]
                 for n in names}
        peer = next(n for n in names if n.startswith("peer"))
        rows = {}
        for n in names:
            rows[n] = {
                "median_ms": 1e3 * statistics.median(steps[n]),
                "p25_ms": 1e3 * _q(steps[n], 0.25), "p75_ms": 1e3 * _q(steps[n], 0.75),
                "ratio": statistics.median(steps[n]) / statistics.median(steps[peer]),
                "paired_ratio": statistics.median(a / b for a, b in zip(steps[n], steps[peer])),
                "paired_ratio_p25_p75": [_q([a / b for a, b in zip(steps[n], steps[peer])], q) for q in (0.25, 0.75)],
                "bubble_local": bubble_fractions([Span(kind, r["rank"], -1, -1, 0, a, b) for r in ranks
                                                  for kind, a, b in r["runs"][key]["bubble"][n]["spans"]]),
                "bubble_shared": run0["bubble"][n]["shared"],
                "peak_mib": [r["runs"][key]["memory"][n]["peak_bytes"] / 2**20 for r in ranks],
                "end_mib": [r["runs"][key]["memory"][n]["end_bytes"] / 2**20 for r in ranks],
                "param_mib": [r["runs"][key]["memory"][n]["param_bytes"] / 2**20 for r in ranks],
                "alone_ms": [1e3 * r["runs"][key]["alone"][n] for r in ranks],
                "busy_ms_per_step": [1e3 * _busy_per_step(r["runs"][key]["bubble"][n]["spans"]) for r in ranks],
                "split": run0["splits"][n],
                "steps_ms": [1e3 * t for t in steps[n]],
            }
        goal_name, goal = goals[scenario]
        met = rows[goal_name]["ratio"] <= goal if goal_name in rows else None
        probes = [[r["runs"][key]["parallelism"][k] for r in ranks] for k in range(len(run0["parallelism"]))]
        parallelism = [statistics.median(sum(p["alone"][i] for p in probe) / max(p["together"][i] for p in probe)
                                         for i in range(len(probe[0]["alone"]))) for probe in probes]
        runs[key] = {"parallelism_before_after": parallelism, "contenders": rows, "peer": peer, "goal": {"contender": goal_name, "ratio": goal, "met": met}}
    return runs


def table(runs: Dict[str, Any]) -> str:
    lines = ["| scenario / schedule | contender | step median ms | p25-p75 ms | vs peer (medians) | paired ratio "
             "(p25-p75) | bubble per rank: trace.record | bubble per rank: BusyRecorder | stage alone ms per rank | "
             "peak MiB per rank | params MiB per rank | parallelism |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    per = lambda xs, f: " / ".join(f.format(x) for x in xs)  # noqa: E731
    for key, run in runs.items():
        for n, r in run["contenders"].items():
            lo, hi = r["paired_ratio_p25_p75"]
            lines.append(f"| {key} | {n} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} | "
                         f"{r['ratio']:.3f} | {r['paired_ratio']:.3f} ({lo:.3f}-{hi:.3f}) | "
                         f"{per(r['bubble_shared'], '{:.2f}') if r['bubble_shared'] else '-'} | "
                         f"{per(r['bubble_local'], '{:.2f}')} | {per(r['alone_ms'], '{:.2f}')} | "
                         f"{per(r['peak_mib'], '{:.1f}')} | "
                         f"{per(r['param_mib'], '{:.2f}')} | {per(run['parallelism_before_after'], '{:.2f}')} |")
    return "\n".join(lines)
