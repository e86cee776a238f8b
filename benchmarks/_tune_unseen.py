"""``benchmarks/tune.py --unseen``: tune's defaults on models it was not built on (issue 33).

For each model of ``_unseen_models.py`` (a ViT, a U-Net-like net with an input skip, a tiny
Qwen3 with tied embeddings), in one process on ``['cpu'] * 4``:

1. ``fxpipe.tune(model, x, devices)`` with its defaults (Adam, ``zero_grad='set_to_none'``,
   every schedule: the distributed ones are left out, the devices repeating) predicts every
   configuration; ``budget`` is then the median predicted peak, and a second
   ``fxpipe.tune(..., memory=budget)`` decides what fits (a real ``memory=``).
2. Each configuration of that second tuning is built from its own arguments and measured on
   full training steps: forward, the model's loss (cross entropy), backward, ``Adam.step()``,
   ``zero_grad()`` (GPipe: ``pipe(x)`` then the loss on the merged output; one-process 1F1B:
   ``pipe.step(x, loss_fn=..., target=y)``). Two warm-up steps (Adam's state exists from the
   first), then the **total** peak of one step: the bytes allocated before it (parameters,
   buffers, Adam's state: their storages, each once) plus its rise
   (``benchmarks/_memory.py``: the CPU allocator's records); and the median of ``steps``
   step times.
3. The configurations said to fit are then timed **side by side**: one pipeline each, built
   together, then ``rounds`` rounds of one full step of each, the order rotated every round;
   per configuration the median over the rounds. On a shared machine a configuration timed
   on its own meets the load of its own minute: measured one after another, the same step
   moved by 0.6-1.5x between rows, more than the 5% the choice is judged by. Interleaved, a
   change of load reaches every configuration alike.
4. Checks: every configuration within 10% (predicted / measured peak); every "fits" honoured
   at a budget 2% above its prediction (measured <= 1.02 x predicted), and within the
   budget itself; the nearest rejected (least predicted peak above the budget) really over
   it; tune's first choice within 5% of the best among those said to fit, on the
   side-by-side medians.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

import fxpipe
from _memory import peak
from _unseen_models import MODELS

MIB = float(1 << 20)


def _before_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes that exist before a step: parameters, buffers, optimizer state (each storage once)."""
    seen: Dict[Any, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(c: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any,
            steps: int) -> Dict[str, float]:
    device = x.device
    pipe = c.pipeline(progress=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    try:
        def step() -> None:
            if c.schedule == "gpipe":
                out = pipe(x)  # kept through the backward, as the guide's loop keeps it
                loss_fn(out, y).backward()
            else:
                pipe.step(x, loss_fn=loss_fn, target=y)
            opt.step()
            opt.zero_grad()  # set_to_none, torch's default and tune's

        step()
        step()
        gc.collect()
        total = _before_step(model, opt) + peak(step, device)["peak_bytes"]
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        pipe.close()
        model.zero_grad(set_to_none=True)
    return {"peak_bytes": float(total), "step_s": statistics.median(times),
            "spread": (max(times) - min(times)) / statistics.median(times)}


def side_by_side(choices: List[Any], model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any,
                 rounds: int) -> List[Dict[str, float]]:
    """Per choice, the median and spread of its step time over ``rounds`` interleaved rounds
    (see the module docstring); every pipeline built first, one Adam over the model."""
    pipes = [c.pipeline(progress=False) for c in choices]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times: List[List[float]] = [[] for _ in choices]
    try:
        def step(k: int) -> None:
            c, pipe = choices[k], pipes[k]
            if c.schedule == "gpipe":
                out = pipe(x)
                loss_fn(out, y).backward()
            else:
                pipe.step(x, loss_fn=loss_fn, target=y)
            opt.step()
            opt.zero_grad()

        for k in range(len(choices)):  # warm-up: Adam's state, each pipeline's first call
            step(k)
        for r in range(rounds):
            for j in range(len(choices)):
                k = (j + r) % len(choices)
                _sync(x.device)
                t0 = time.perf_counter()
                step(k)
                _sync(x.device)
                times[k].append(time.perf_counter() - t0)
    finally:
        for pipe in pipes:
            pipe.close()
        model.zero_grad(set_to_none=True)
    return [{"median_s": statistics.median(t), "spread": (max(t) - min(t)) / statistics.median(t)} for t in times]


def run(name: str, chunks: List[int], steps: int, rounds: int = 9,
        balance_by: Optional[str] = None, device: str = "cpu") -> Dict[str, Any]:
    """``balance_by``: tune's (default: profiled time, a cut that moves with the machine's load;
    'params' or 'memory' for a cut that does not, another one to validate the memory on).
    ``device='cuda'``: the four stages on the GPU, the peak from ``torch.cuda.max_memory_allocated``."""
    model, x, y, loss_fn, what = MODELS[name]()
    if device != "cpu":
        model, x, y = model.to(device), x.to(device), y.to(device)
    devices = [device] * 4
    t0 = time.perf_counter()
    free = fxpipe.tune(model, x, devices, chunks=chunks, loss_fn=loss_fn, target=y, balance_by=balance_by)
    budget = statistics.median(c.peak for c in free.choices if c.peak_bytes)
    tuning = fxpipe.tune(model, x, devices, budget, chunks=chunks, loss_fn=loss_fn, target=y, balance_by=balance_by)
    tune_s = time.perf_counter() - t0
    print(f"\n{what}: two fxpipe.tune calls took {tune_s:.1f} s; memory={budget / MIB:.2f} MiB\n{tuning}")
    rows = []
    for c in tuning.choices:
        if not c.peak_bytes:
            continue
        got = measure(c, model, x, y, loss_fn, steps)
        gc.collect()
        rows.append({"schedule": c.schedule, "chunks": c.chunks, "checkpoint": c.checkpoint, "fits": c.fits,
                     "predicted_bytes": c.peak, "measured_bytes": got["peak_bytes"],
                     "memory_ratio": c.peak / got["peak_bytes"], "predicted_s": c.step_s,
                     "measured_s": got["step_s"], "time_ratio": c.step_s / got["step_s"],
                     "step_spread": got["spread"]})
    fit = [r for r in rows if r["fits"]]
    fitting = [c for c in tuning.choices if c.peak_bytes and c.fits]
    for r, got in zip(fit, side_by_side(fitting, model, x, y, loss_fn, rounds)):
        r["side_by_side_s"], r["side_by_side_spread"] = got["median_s"], got["spread"]
        r["time_ratio_side_by_side"] = r["predicted_s"] / got["median_s"]
    rejected = sorted((r for r in rows if not r["fits"]), key=lambda r: r["predicted_bytes"])
    first = fit[0] if fit else None  # rows follow tune's ranking
    best = min(fit, key=lambda r: r["side_by_side_s"]) if fit else None
    return {"model": name, "description": what, "balance_by": balance_by or "time",
            "plan": [[int(s.index), s.nodes[0], s.nodes[-1]] for s in tuning.choices[0].plan.stages]
            if tuning.choices and tuning.choices[0].plan else None, "budget_bytes": budget, "tune_s": tune_s, "rows": rows,
            "notes": tuning.notes,
            "fits_honoured": all(r["measured_bytes"] <= 1.02 * r["predicted_bytes"] for r in fit),
            "fits_within_budget": all(r["measured_bytes"] <= budget for r in fit),
            "nearest_rejected_over": (rejected[0]["measured_bytes"] > budget) if rejected else None,
            "first": first and [first["schedule"], first["chunks"], first["checkpoint"]],
            "best_measured": best and [best["schedule"], best["chunks"], best["checkpoint"]],
            "choice_ratio": first["side_by_side_s"] / best["side_by_side_s"] if first and best else None,
            "choice_ratio_one_by_one": (first["measured_s"] / min(r["measured_s"] for r in fit)) if first else None,
            "rounds": rounds}


def print_table(res: Dict[str, Any]) -> None:
    print(f"\n{res['description']}: memory={res['budget_bytes'] / MIB:.2f} MiB")
    print("| schedule | chunks | checkpoint | fits | predicted MiB | measured MiB | pred/meas | predicted ms "
          "| measured ms (median) | pred/meas |")
    print("|---|--:|---|---|--:|--:|--:|--:|--:|--:|")
    for r in res["rows"]:
        print(f"| {r['schedule']} | {r['chunks']} | {r['checkpoint']} | {'yes' if r['fits'] else 'no'} "
              f"| {r['predicted_bytes'] / MIB:.2f} | {r['measured_bytes'] / MIB:.2f} | {r['memory_ratio']:.3f} "
              f"| {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['time_ratio']:.2f} |")
    print("\nside by side (the configurations said to fit, interleaved rounds):")
    print("| schedule | chunks | checkpoint | predicted ms | median ms | spread | pred/meas |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for r in res["rows"]:
        if "side_by_side_s" in r:
            print(f"| {r['schedule']} | {r['chunks']} | {r['checkpoint']} | {r['predicted_s'] * 1e3:.1f} "
                  f"| {r['side_by_side_s'] * 1e3:.1f} | {r['side_by_side_spread']:.2f} "
                  f"| {r['time_ratio_side_by_side']:.2f} |")
    ratio = res["choice_ratio"]
    print(f"every fits honoured at +2%: {res['fits_honoured']}; within the budget: {res['fits_within_budget']}; "
          f"nearest rejected over it: {res['nearest_rejected_over']}; first {res['first']} / best measured "
          f"{res['best_measured']}: {ratio if ratio is None else round(ratio, 3)}")
