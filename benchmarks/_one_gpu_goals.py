"""Issue 21's goals, read off ``benchmarks/one_gpu.py``'s rows (a goal whose rows did not
run, or did not pass their exactness check, is listed as not measured)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def _ok(rows: List[Dict[str, Any]], key: str) -> Optional[Dict[str, Any]]:
    return next((r for r in rows if r["key"] == key and r.get("status") == "ok"), None)


def _ratio(rows: List[Dict[str, Any]], key: str, base: str, what: str) -> Optional[float]:
    r, b = _ok(rows, key), _ok(rows, base)
    if r is None or b is None:
        return None
    return r[what] / b[what] if b[what] else None


def _cheaper_than(rows: List[Dict[str, Any]], base: str, compiled: bool) -> Dict[str, Any]:
    """The fastest pipeline row (compiled or not) at no more memory than ``base``: its time over base's."""
    b = _ok(rows, base)
    if b is None:
        return {"value": None, "row": None}
    fits = [r for r in rows if r["key"].startswith("pipe:") and r.get("status") == "ok"
            and r["key"].endswith((":compile", ":ro")) == compiled and r["peak_bytes"] <= b["peak_bytes"]]
    if not fits:
        return {"value": None, "row": "no pipeline row at or under its memory"}
    best = min(fits, key=lambda r: r["median_s"])
    return {"value": best["median_s"] / b["median_s"], "row": best["key"]}


def goals(rows: List[Dict[str, Any]], chunks: int) -> List[Dict[str, Any]]:
    """Each goal: what, the measured ratio (None: not measured), its target, and the row(s)."""
    c = chunks
    found = [
        ("§0 chunks=1 'never' time / eager", _ratio(rows, "pipe:1:never", "eager", "median_s"), 1.02,
         "pipe:1:never / eager"),
        ("§0 chunks=1 'never' memory / eager", _ratio(rows, "pipe:1:never", "eager", "peak_bytes"), 1.02,
         "pipe:1:never / eager"),
        (f"§0 chunks={c} 'never' time / eager accumulation over {c}",
         _ratio(rows, f"pipe:{c}:never", "accum", "median_s"), 1.03, f"pipe:{c}:never / accum"),
        (f"§1 chunks={c} 'never' with graphs / reduce-overhead accumulation (the floor)",
         _ratio(rows, f"pipe:{c}:never:ro", "ro_accum", "median_s"), 1.10, f"pipe:{c}:never:ro / ro_accum"),
        (f"§1 chunks={c} 'never' with graphs / whole-batch reduce-overhead",
         _ratio(rows, f"pipe:{c}:never:ro", "ro", "median_s"), 1.25, f"pipe:{c}:never:ro / ro"),
        (f"§1 chunks={c} 'never' with graphs / whole-batch torch.compile",
         _ratio(rows, f"pipe:{c}:never:ro", "compiled", "median_s"), 1.25, f"pipe:{c}:never:ro / compiled"),
    ]
    out = [{"goal": g, "value": v, "target": t, "rows": k} for g, v, t, k in found]
    for base, compiled in (("hf_ckpt", False), ("compiled_hf_ckpt", True)):
        best = _cheaper_than(rows, base, compiled)
        out.append({"goal": f"§2 fastest {'compiled ' if compiled else ''}pipeline at <= {base}'s memory: "
                            f"time / {base}", "value": best["value"], "target": 1.0,
                    "rows": f"{best['row']} / {base}" if best["row"] and best["value"] else (best["row"] or base)})
    return out


def print_goals(model: str, found: List[Dict[str, Any]]) -> None:
    measured = [g for g in found if g["value"] is not None]
    if measured:
        print()
        print(f"Issue 21 goals on {model} (a ratio <= its target is met):")
        print("| goal | rows | measured | target | met |")
        print("|---|---|--:|--:|---|")
        for g in measured:
            met = "yes" if g["value"] <= g["target"] else "**no**"
            print(f"| {g['goal']} | {g['rows']} | {g['value']:.3f} | {g['target']:.2f} | {met} |")
    missing = [g["goal"] for g in found if g["value"] is None]
    if missing:
        print(f"\nnot measured on {model} (rows not run, refused, failed, or none fits): " + "; ".join(missing))
