"""``fxpipe.tune``'s predictions against measurements, in one run (one process; CPU, or ``--device cuda``).

For each model (``tests/zoo.py``'s ``TinyGPT(vocab=64, d=64, heads=4, layers=8, ctx=64)`` on
``32 x 64`` tokens and ``UNet(c=16)`` on ``32 x 3 x 64 x 64``, as ``activation_memory.py``),
``fxpipe.tune(model, x, [DEVICE] * 4, schedules=('gpipe',), chunks=CHUNKS, zero_grad='in_place')`` predicts every
(chunks, checkpoint) configuration; then each is built with the tuning's own arguments
(``choice.kwargs``: the same plan) and measured:

* **memory**: the peak of one training step (``out = model(x); out.float().pow(2).mean().backward()``
  after one warm-up step, gradients zeroed in place), measured as ``activation_memory.py``
  measures it (``benchmarks/_memory.py``: the CPU allocator's records; on CUDA
  ``max_memory_allocated`` above the allocation before the step), against the predicted
  peak activation bytes (``choice.activation_bytes``; parameters and gradients exist before
  the step and are in neither);
* **time**: the fastest of ``--steps`` steps (other work on the machine only adds time;
  synchronized on CUDA) against the predicted step time;
* **choice**: for each memory budget (no limit, and budgets that rule out the largest
  configurations), tune's first-ranked configuration against the best measured among the
  configurations it found to fit (measured time), and whether that one fits when measured.
  Budgets filter the one tuning's predictions, as ``fxpipe.tune(..., memory=budget)`` does
  (a second call would profile again, and plan on other timings).

With ``--unseen`` (``benchmarks/_tune_unseen.py``): tune's defaults (Adam, ``set_to_none``,
every schedule, a real ``memory=``) on three models it was not built on (a ViT, a U-Net-like
net with an input skip, a tiny Qwen3 with tied embeddings): the **total** peak of full
training steps (parameters, gradients, Adam's state, activations) against the prediction,
whether every "fits" fits, and tune's first choice against the best measured.

With ``--distributed`` (``benchmarks/_tune_dist.py``): the distributed schedules on 2 gloo
ranks (CPU), each rank's predicted activation peak against its measured one, each rank's
measured action order against the simulated one, step times and tune's first choice.

Usage::

    .venv/bin/python benchmarks/tune.py                 # both models
    .venv/bin/python benchmarks/tune.py --models gpt --steps 3
    .venv/bin/python benchmarks/tune.py --distributed   # also the gloo ranks
    .venv/bin/python benchmarks/tune.py --unseen --out benchmarks/results/tune_unseen.json  # issue 33's check
    python benchmarks/tune.py --device cuda --chunks 1 4 8 --out results/gpu/tune_cuda.json   # one GPU
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from zoo import TinyGPT, UNet  # noqa: E402

from _memory import peak  # noqa: E402
from _results import header, write_json  # noqa: E402
from _tune_dist import cut  # noqa: E402

torch.set_num_threads(1)
MIB = float(1 << 20)


def step(model: Any, x: torch.Tensor) -> None:
    out = model(x)
    out.float().pow(2).mean().backward()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(name: str) -> tuple:
    torch.manual_seed(0)
    if name == "unet":
        return UNet(16), torch.randn(32, 3, 64, 64), "UNet(c=16), input 32x3x64x64"
    return TinyGPT(64, 64, 4, 8, 64), torch.randint(0, 64, (32, 64)), "TinyGPT(64, d=64, 4 heads, 8 layers, ctx 64), 32x64"


def measure(pipe: Any, x: torch.Tensor, steps: int) -> Dict[str, float]:
    step(pipe, x)  # warm-up: .grad exists from now on
    for p in pipe.parameters():
        if p.grad is not None:
            p.grad.zero_()
    gc.collect()
    mem = peak(lambda: step(pipe, x), x.device)["peak_bytes"]
    times = []
    for _ in range(steps):
        sync(x.device)
        t0 = time.perf_counter()
        step(pipe, x)
        sync(x.device)
        times.append(time.perf_counter() - t0)
    return {"peak_bytes": mem, "step_s": min(times)}  # interference only adds time: the fastest step


def run_model(name: str, a: argparse.Namespace) -> Dict[str, Any]:
    model, x, what = build(name)
    model, x = model.to(a.device), x.to(a.device)
    t0 = time.perf_counter()
    # measure() zeroes .grad in place between steps: it exists through each measured backward
    tuning = fxpipe.tune(model, x, [a.device] * a.stages, None, schedules=("gpipe",), chunks=a.chunks,
                         optimizer="sgd", balance_by=a.balance_by, zero_grad="in_place")
    tune_s = time.perf_counter() - t0
    print(f"\n{what}: fxpipe.tune took {tune_s:.1f} s\n{tuning}")
    rows = []
    for c in tuning.choices:
        pipe = c.pipeline(progress=False)
        try:
            got = measure(pipe, x, a.steps)
        finally:
            pipe.close()
        del pipe
        gc.collect()
        label = next(iter(c.activation_bytes))  # the one device
        rows.append({"chunks": c.chunks, "checkpoint": c.checkpoint, "predicted_bytes": c.activation_bytes[label],
                     "static_bytes": c.static_bytes[label], "measured_bytes": got["peak_bytes"],
                     "memory_ratio": c.activation_bytes[label] / got["peak_bytes"],
                     "predicted_s": c.step_s, "measured_s": got["step_s"], "time_ratio": c.step_s / got["step_s"]})
    choices = []
    static = rows[0]["static_bytes"]
    peaks = sorted(r["predicted_bytes"] for r in rows)
    budgets: List[Optional[float]] = [None] + [static + peaks[int(q * (len(peaks) - 1))] * 1.02 for q in (0.25, 0.5, 0.75)]
    for budget in budgets:  # the same predictions, filtered as tune filters them (no second profile)
        fit = [c for c in tuning.choices if budget is None or c.peak <= budget]
        if not fit:
            choices.append({"budget_bytes": budget, "refused": "nothing fits"})
            continue
        keys = {(c.chunks, c.checkpoint) for c in fit}
        candidates = [r for r in rows if (r["chunks"], r["checkpoint"]) in keys]
        best = min(candidates, key=lambda r: r["measured_s"])
        first = next(r for r in rows if (r["chunks"], r["checkpoint"]) == (fit[0].chunks, fit[0].checkpoint))
        fits_measured = budget is None or first["measured_bytes"] + static <= budget
        choices.append({"budget_bytes": budget, "first": [first["chunks"], first["checkpoint"]],
                        "best_measured": [best["chunks"], best["checkpoint"]], "first_s": first["measured_s"],
                        "best_s": best["measured_s"], "ratio": first["measured_s"] / best["measured_s"],
                        "first_fits_measured": fits_measured, "candidates": len(candidates)})
    return {"model": name, "description": what, "device": a.device, "stages": a.stages, "tune_s": tune_s,
            "cut": cut(tuning.choices[0].plan), "rows": rows,
            "choices": choices}



def print_tables(res: Dict[str, Any]) -> None:
    print(f"\n{res['description']} ({res['stages']} stages on one {res['device']})")
    print("| chunks | checkpoint | predicted MiB | measured MiB | pred/meas | predicted ms | measured ms | pred/meas |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    for r in res["rows"]:
        print(f"| {r['chunks']} | {r['checkpoint']} | {r['predicted_bytes'] / MIB:.2f} | {r['measured_bytes'] / MIB:.2f} "
              f"| {r['memory_ratio']:.3f} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['time_ratio']:.2f} |")
    print("\n| memory budget | tune's first | best measured among fitting | first / best (time) | first fits measured |")
    print("|---|---|---|--:|---|")
    for c in res["choices"]:
        budget = "no limit" if c["budget_bytes"] is None else f"{c['budget_bytes'] / MIB:.1f} MiB"
        if "refused" in c:
            print(f"| {budget} | refused | | | |")
            continue
        print(f"| {budget} | chunks {c['first'][0]}, {c['first'][1]} | chunks {c['best_measured'][0]}, "
              f"{c['best_measured'][1]} | {c['ratio']:.3f} | {'yes' if c['first_fits_measured'] else 'NO'} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt", "unet"], choices=["gpt", "unet"])
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 4, 8, 32])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--out", default=None)
    p.add_argument("--distributed", action="store_true", help="also the distributed schedules on gloo ranks")
    p.add_argument("--only-distributed", action="store_true", help="only the gloo ranks")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dist-chunks", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="one process's device (every stage on it); the gloo ranks stay on the CPU")
    p.add_argument("--balance-by", choices=("time", "memory", "params"), default=None,
                   help="how the stages are cut (default: profiled time, which may cut differently run to run)")
    p.add_argument("--unseen", nargs="*", default=None, choices=["vit", "unet", "qwen3"],
                   help="tune's defaults on models it was not built on (all three if none named), then exit")
    p.add_argument("--unseen-chunks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=9,
                   help="--unseen: interleaved rounds timing the configurations said to fit side by side")
    a = p.parse_args(argv)
    if a.unseen is not None:
        return unseen(a, argv)
    results = []
    for name in ([] if a.only_distributed else a.models):
        res = run_model(name, a)
        print_tables(res)
        results.append(res)
    distributed = []
    if a.distributed or a.only_distributed:
        import tempfile

        import _tune_dist

        for name in a.models:
            model, x, what = build(name)
            with tempfile.TemporaryDirectory() as tmp:
                res = _tune_dist.run(model, x, a.world, a.dist_chunks, Path(tmp), what, a.balance_by)
            _tune_dist.print_table(res)
            distributed.append(res)
    worst_mem = max((abs(1 - r["memory_ratio"]) for res in results for r in res["rows"]), default=0.0)
    worst_choice = max((c["ratio"] for res in results for c in res["choices"] if "ratio" in c), default=1.0)
    print(f"\nworst memory error {worst_mem:.1%} (goal 10%); worst first/best measured time {worst_choice:.3f} (goal 1.05)")
    if distributed:
        rows = [r for res in distributed for r in res["rows"]]
        print(f"gloo ranks: worst memory error {max(abs(1 - r['memory_ratio']) for r in rows):.1%}; action order "
              f"as simulated on {sum(r['order_same'] for r in rows)} of {len(rows)} (configuration, rank)")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / ("tune.json" if a.device == "cpu" else
                                                                      f"tune_{a.device}.json")
    doc = {**header("tune", a.device),
           "command": " ".join(["benchmarks/tune.py", *(argv if argv is not None else sys.argv[1:])]),
           "worst_memory_error": worst_mem, "worst_choice_ratio": worst_choice, "models": results,
           "distributed": distributed}
    write_json(str(out), doc)


def unseen(a: argparse.Namespace, argv: Optional[Sequence[str]]) -> None:
    import _tune_unseen

    results = []
    for name in a.unseen or ["vit", "unet", "qwen3"]:
        res = _tune_unseen.run(name, a.unseen_chunks, a.steps, a.rounds, balance_by=a.balance_by, device=a.device)
        _tune_unseen.print_table(res)
        results.append(res)
    rows = [r for res in results for r in res["rows"]]
    worst = max(abs(1 - r["memory_ratio"]) for r in rows)
    within = sum(abs(1 - r["memory_ratio"]) <= 0.10 for r in rows)
    ratios = [res["choice_ratio"] for res in results if res["choice_ratio"] is not None]
    print(f"\nmemory within 10% on {within} of {len(rows)} (worst {worst:.1%}); every fits honoured at +2%: "
          f"{all(res['fits_honoured'] for res in results)}; worst first/best time side by side "
          f"{max(ratios, default=float('nan')):.3f} (goal 1.05)")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "tune_unseen.json"
    write_json(str(out), {**header("tune --unseen", a.device),
                          "command": " ".join(["benchmarks/tune.py", *(argv if argv is not None else sys.argv[1:])]),
                          "worst_memory_error": worst, "within_10pct": within, "configurations": len(rows),
                          "worst_choice_ratio": max(ratios, default=None), "models": results})


if __name__ == "__main__":
    main()
