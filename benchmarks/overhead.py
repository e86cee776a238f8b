"""Runtime overhead of fxpipe.GPipe vs torchgpipe 0.0.7 vs eager, on CPU, in one run.

Model: 8 x nn.Linear(16, 16) as an nn.Sequential, batch 64, ``torch.set_num_threads(1)``.
The model is so small that almost all of a pipelined step is framework overhead.

For every n (partitions) in {1, 2, 4, 8}, m (chunks) in {1, 8, 32} and checkpoint in
{'never', 'except_last'}, one *step* is ``out = model(x); out.sum().backward()``, timed with
``time.perf_counter`` (gradients are reset outside the timed region). Each repetition visits
every configuration in a fresh random order and, inside a configuration, times eager,
fxpipe and torchgpipe in a rotating order, so slow drifts of a shared, noisy machine hit
all contenders alike. Reported: medians per configuration.

Derived, per framework and checkpoint mode, by least squares over the (n, m) grid:

    median_step(framework) - median_step(eager)  ~=  fixed + per_task * n * m

``fixed`` is the overhead per call (us), ``per_task`` the overhead per (micro-batch,
partition) task, forward + backward (us). Targets (from the issue): fxpipe's per-task
overhead at most 1/4 of torchgpipe's, and fxpipe's per-call overhead at most 1 ms.

Usage::

    .venv/bin/python benchmarks/overhead.py               # full run, writes results/overhead.json
    .venv/bin/python benchmarks/overhead.py --quick       # smoke run (small grid, 3 repetitions)
    .venv/bin/python benchmarks/overhead.py --repeat 50   # more repetitions
    python benchmarks/overhead.py --device cuda --quick   # stages on the GPU(s), see _device.py

With ``--device cuda`` the same tiny model runs on ``devices=['cuda:0'] * n`` (or contiguous
stages per GPU), steps are synchronized (``_device.timed``), and the overhead then includes
kernel launches, copy streams and the worker threads a CPU run does not use.

torchgpipe compatibility shim: torchgpipe 0.0.7 (2020) is imported unmodified. If its import
fails on a known removed torch API (``torch._six``), a stub ``torch._six`` module is
injected into ``sys.modules`` and the import is retried; the JSON and the printed header
say whether the shim was needed (with torch 2.13 it is not: 0.0.7 imports and runs as is).

Threads: ``torch.set_num_threads(1)`` only configures the calling thread's OpenMP/MKL team.
Both pipelines compute on worker threads created with Python's ``threading``, which start
with the OpenMP default (all cores): there a tiny Linear runs ~3x slower, with tails of
tens of ms on a loaded machine. So, unless ``--no-thread-env`` is given, the benchmark sets
``OMP_NUM_THREADS=1`` and ``MKL_NUM_THREADS=1`` before importing torch, making every
thread single-threaded, as the eager baseline is.

fxpipe's pipelines are closed (``close()``) before exit, so their worker threads end while
the interpreter is fully alive: waking daemon threads during interpreter shutdown aborts
the process now and then ("terminate called without an active exception").
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Tuple

if "--no-thread-env" not in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Import fxpipe from this checkout (the editable install may be stale).
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import fxpipe  # noqa: E402
sys.path.insert(0, str(HERE))
from _device import add_device_argument, check_device, first_device, label, stage_devices, timed  # noqa: E402

FRAMEWORKS = ("eager", "eager_mb", "fxpipe", "torchgpipe")
PIPELINES = ("fxpipe", "torchgpipe")
# Baseline -> name of the per-configuration overhead it defines.
BASELINES = {"eager": "overhead_us", "eager_mb": "net_overhead_us"}
CHECKPOINTS = ("never", "except_last")
WIDTH, DEPTH, BATCH = 16, 8, 64


# --------------------------------------------------------------------------------------
# torchgpipe 0.0.7 compatibility shim (applied only if the plain import fails).
# --------------------------------------------------------------------------------------

def import_torchgpipe() -> Tuple[types.ModuleType, List[str]]:
    """Imports torchgpipe unmodified; returns the module and the shims that were needed."""
    shims: List[str] = []
    try:
        import torchgpipe  # type: ignore
        return torchgpipe, shims
    except ModuleNotFoundError as exc:
        if exc.name != "torch._six":
            raise
    # torch._six was removed in torch 2.0; torchgpipe only used its aliases.
    import collections.abc

    six = types.ModuleType("torch._six")
    six.string_classes = (str, bytes)  # type: ignore[attr-defined]
    six.int_classes = int  # type: ignore[attr-defined]
    six.container_abcs = collections.abc  # type: ignore[attr-defined]
    six.inf = math.inf  # type: ignore[attr-defined]
    six.nan = math.nan  # type: ignore[attr-defined]
    sys.modules["torch._six"] = six
    torch._six = six  # type: ignore[attr-defined]
    shims.append("stub torch._six (string_classes, int_classes, container_abcs, inf, nan)")
    for name in [k for k in sys.modules if k == "torchgpipe" or k.startswith("torchgpipe.")]:
        del sys.modules[name]
    import torchgpipe  # type: ignore
    return torchgpipe, shims


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

def even_balance(layers: int, n: int) -> List[int]:
    q, r = divmod(layers, n)
    return [q + 1 if k < r else q for k in range(n)]


def make_base(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


class MicroBatchedEager(nn.Module):
    """The plain model run on each of the m micro-batches in turn: the pipeline's compute only."""

    def __init__(self, module: nn.Sequential, chunks: int) -> None:
        super().__init__()
        self.module = module
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.module(c) for c in x.chunk(self.chunks)])


def build(framework: str, base: nn.Sequential, tg: types.ModuleType, n: int, m: int, ck: str,
          device: str = "cpu") -> nn.Module:
    model = copy.deepcopy(base)
    if framework == "eager":
        return model.to(first_device(device))
    if framework == "eager_mb":
        return MicroBatchedEager(model.to(first_device(device)), m)
    lib = fxpipe if framework == "fxpipe" else tg
    return lib.GPipe(model, even_balance(DEPTH, n), devices=stage_devices(device, n), chunks=m, checkpoint=ck)


def step_fn(model: nn.Module, x: torch.Tensor, device: str = "cpu") -> Callable[[], float]:
    params = list(model.parameters())

    def run() -> None:
        model(x).sum().backward()

    def step() -> float:
        for p in params:
            p.grad = None
        if device == "cuda":
            return timed(device, run)
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    return step


def check_gradients(models: Dict[str, nn.Module], x: torch.Tensor) -> float:
    """Max |grad - eager grad| over all parameters: the pipelines must compute the same step."""
    grads = {}
    for name, model in models.items():
        for p in model.parameters():
            p.grad = None
        model(x).sum().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    ref = grads["eager"]
    return max(
        (g.to(r.device) - r).abs().max().item() for name in models if name != "eager" for g, r in zip(grads[name], ref)
    )


# --------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------

def q(xs: List[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def fit(points: List[Tuple[int, int, float]]) -> Dict[str, float]:
    """Least squares: overhead_us ~= fixed + per_task * n * m."""
    tasks = np.array([n * m for n, m, _ in points], dtype=float)
    y = np.array([v for _, _, v in points], dtype=float)
    a = np.stack([np.ones_like(tasks), tasks], axis=1)
    (fixed, per_task), *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ np.array([fixed, per_task])
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {
        "fixed_us": float(fixed),
        "per_task_us": float(per_task),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        "max_abs_residual_us": float(np.abs(y - pred).max()),
    }


def stop_fxpipe_workers(models: List[nn.Module]) -> None:
    """Stops fxpipe's worker threads while the interpreter is fully alive (see the docstring)."""
    for model in models:
        model.close()  # fxpipe.GPipe: stops and joins its worker threads


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: n in {1,2,4}, m in {1,8}, 3 repetitions")
    ap.add_argument("--repeat", type=int, default=None, help="timed repetitions per configuration (default 40; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per model before timing (default 3; 1 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-thread-env", action="store_true",
                    help="do not set OMP_NUM_THREADS=1 / MKL_NUM_THREADS=1 (worker threads then use all cores)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON output (default results/overhead[-cuda][-quick].json)")
    add_device_argument(ap)
    args = ap.parse_args()
    check_device(args.device)

    ns = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    ms = (1, 8) if args.quick else (1, 8, 32)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    dev = "" if args.device == "cpu" else f"-{args.device}"
    out_path = args.out or HERE / "results" / (f"overhead{dev}-quick.json" if args.quick else f"overhead{dev}.json")

    torch.set_num_threads(1)
    tg, shims = import_torchgpipe()
    started = _dt.datetime.now().astimezone()
    load_before = os.getloadavg()

    print(f"fxpipe {fxpipe.__version__} | torchgpipe {tg.__version__} | torch {torch.__version__} | "
          f"python {platform.python_version()}")
    print(f"CPU: {cpu_name()} x {os.cpu_count()} logical; torch threads 1; load avg {load_before[0]:.2f}; "
          f"stages on {label(args.device)}")
    print(f"torchgpipe shim: {'; '.join(shims) if shims else 'none needed (0.0.7 imports unmodified)'}")
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
          f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', 'unset')}")
    print(f"grid: n={list(ns)} m={list(ms)} checkpoint={list(CHECKPOINTS)}; repeat={repeat} warmup={warmup}")

    base = make_base(args.seed)
    torch.manual_seed(args.seed + 1)
    x = torch.randn(BATCH, WIDTH).to(first_device(args.device))
    configs = [(ck, n, m) for ck in CHECKPOINTS for n in ns for m in ms]

    steps: Dict[Tuple[str, int, int], Dict[str, Callable[[], float]]] = {}
    pipelines: List[nn.Module] = []
    max_grad_err = 0.0
    for cfg in configs:
        ck, n, m = cfg
        models = {fw: build(fw, base, tg, n, m, ck, args.device) for fw in FRAMEWORKS}
        for model in models.values():
            model.train()
        max_grad_err = max(max_grad_err, check_gradients(models, x))
        steps[cfg] = {fw: step_fn(model, x, args.device) for fw, model in models.items()}
        pipelines.append(models["fxpipe"])
        for fw in FRAMEWORKS:
            for _ in range(warmup):
                steps[cfg][fw]()
    print(f"gradients match eager: max abs error {max_grad_err:.2e}")

    samples: Dict[Tuple[str, int, int], Dict[str, List[float]]] = {
        cfg: {fw: [] for fw in FRAMEWORKS} for cfg in configs
    }
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    for rep in range(repeat):
        order = configs[:]
        rng.shuffle(order)
        gc.collect()
        for cfg in order:
            rot = (rep + configs.index(cfg)) % len(FRAMEWORKS)
            for fw in FRAMEWORKS[rot:] + FRAMEWORKS[:rot]:
                samples[cfg][fw].append(steps[cfg][fw]() * 1e6)
        if not args.quick and (rep + 1) % max(1, repeat // 10) == 0:
            print(f"  repetition {rep + 1}/{repeat} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    elapsed = time.perf_counter() - t_start
    load_after = os.getloadavg()
    stop_fxpipe_workers(pipelines)

    # ---- per-configuration medians -------------------------------------------------------
    rows = []
    for ck, n, m in configs:
        s = samples[(ck, n, m)]
        med = {fw: statistics.median(s[fw]) for fw in FRAMEWORKS}
        row = {
            "checkpoint": ck, "n": n, "m": m, "balance": even_balance(DEPTH, n), "tasks": n * m,
            "median_us": med,
            "p25_us": {fw: q(s[fw], 25) for fw in FRAMEWORKS},
            "p75_us": {fw: q(s[fw], 75) for fw in FRAMEWORKS},
            "ratio_step_fx_over_tg": med["fxpipe"] / med["torchgpipe"],
        }
        for base_name, key in BASELINES.items():
            ovh = {fw: med[fw] - med[base_name] for fw in PIPELINES}
            row[key] = ovh
            row[f"ratio_{key}_fx_over_tg"] = ovh["fxpipe"] / ovh["torchgpipe"] if ovh["torchgpipe"] > 0 else None
        row["samples_us"] = {fw: [round(v, 1) for v in s[fw]] for fw in FRAMEWORKS}
        rows.append(row)

    def ratio_str(v: object) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "n/a"

    hdr = (f"{'ckpt':<12}{'n':>2}{'m':>4} | {'eager':>6}{'eag_mb':>7}{'fxpipe':>8}{'tgpipe':>8} | "
           f"{'ovh fx':>7}{'ovh tg':>8}{'fx/tg':>6} | {'net fx':>7}{'net tg':>8}{'fx/tg':>6} | {'step fx/tg':>10}")
    print()
    print("step = forward + backward of out.sum(); medians in us. ovh = step - eager; "
          "net = step - eager_mb (eager run on the m micro-batches)")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        med, ovh, net = r["median_us"], r["overhead_us"], r["net_overhead_us"]
        print(f"{r['checkpoint']:<12}{r['n']:>2}{r['m']:>4} | {med['eager']:>6.0f}{med['eager_mb']:>7.0f}"
              f"{med['fxpipe']:>8.0f}{med['torchgpipe']:>8.0f} | {ovh['fxpipe']:>7.0f}{ovh['torchgpipe']:>8.0f}"
              f"{ratio_str(r['ratio_overhead_us_fx_over_tg']):>6} | {net['fxpipe']:>7.0f}{net['torchgpipe']:>8.0f}"
              f"{ratio_str(r['ratio_net_overhead_us_fx_over_tg']):>6} | {r['ratio_step_fx_over_tg']:>10.2f}")

    # ---- fits ------------------------------------------------------------------------------
    fits: Dict[str, Dict[str, Dict[str, Dict[str, float]]]] = {}
    targets: Dict[str, Dict[str, Dict[str, object]]] = {}
    for base_name, key in BASELINES.items():
        fits[base_name], targets[base_name] = {}, {}
        print()
        print(f"least-squares fit over the (n, m) grid: step - {base_name} ~= fixed + per_task * n * m"
              + ("   [the fit the issue asks for]" if base_name == "eager" else
                 "   [micro-batch compute removed]"))
        print(f"  {'ckpt':<12}{'framework':<12}{'fixed (us)':>11}{'per task (us)':>15}{'R^2':>7}{'max resid (us)':>16}")
        for ck in CHECKPOINTS:
            fits[base_name][ck] = {}
            for fw in PIPELINES:
                pts = [(r["n"], r["m"], r[key][fw]) for r in rows if r["checkpoint"] == ck]
                f = fits[base_name][ck][fw] = fit(pts)
                print(f"  {ck:<12}{fw:<12}{f['fixed_us']:>11.0f}{f['per_task_us']:>15.1f}{f['r2']:>7.3f}"
                      f"{f['max_abs_residual_us']:>16.0f}")
            fx, tgf = fits[base_name][ck]["fxpipe"], fits[base_name][ck]["torchgpipe"]
            ratio = fx["per_task_us"] / tgf["per_task_us"] if tgf["per_task_us"] > 0 else float("nan")
            targets[base_name][ck] = {
                "per_task_ratio_fx_over_tg": ratio,
                "per_task_ratio_target": 0.25,
                "per_task_met": bool(ratio <= 0.25),
                "fixed_fx_us": fx["fixed_us"],
                "fixed_fx_target_us": 1000.0,
                "fixed_met": bool(fx["fixed_us"] <= 1000.0),
                "fixed_ratio_fx_over_tg": fx["fixed_us"] / tgf["fixed_us"] if tgf["fixed_us"] > 0 else None,
            }
    print()
    print("targets: fxpipe per-task overhead <= 1/4 of torchgpipe's; fxpipe per-call overhead <= 1000 us")
    for base_name in BASELINES:
        for ck in CHECKPOINTS:
            t = targets[base_name][ck]
            print(f"  vs {base_name:<9}{ck:<12} per-task fx/tg = {t['per_task_ratio_fx_over_tg']:.2f} "
                  f"({'met' if t['per_task_met'] else 'MISSED'}); fixed fx = {t['fixed_fx_us']:.0f} us "
                  f"({'met' if t['fixed_met'] else 'MISSED'})")
    print(f"\nmeasured {repeat} repetitions x {len(configs)} configurations x {len(FRAMEWORKS)} in {elapsed:.0f} s; "
          f"load avg {load_before[0]:.2f} -> {load_after[0]:.2f}")

    result = {
        "benchmark": "overhead",
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "benchmarks/overhead.py"] + sys.argv[1:]),
        "machine": {
            "cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_before": load_before, "load_avg_after": load_after,
            "note": "shared machine, timings are noisy; medians of interleaved repetitions",
        },
        "versions": {"fxpipe": fxpipe.__version__, "torchgpipe": tg.__version__, "torch": torch.__version__,
                     "numpy": np.__version__},
        "torchgpipe_shims": shims,
        "model": f"nn.Sequential of {DEPTH} x nn.Linear({WIDTH}, {WIDTH}), batch {BATCH}",
        "devices": {n: stage_devices(args.device, n) for n in ns}, "device": label(args.device),
        "step": "out = model(x); out.sum().backward() (grads reset outside the timed region)",
        "grid": {"n": list(ns), "m": list(ms), "checkpoint": list(CHECKPOINTS)},
        "repeat": repeat, "warmup": warmup, "elapsed_s": elapsed,
        "max_grad_error_vs_eager": max_grad_err,
        "baselines": {
            "eager": "the plain nn.Sequential on the whole batch",
            "eager_mb": "the plain nn.Sequential on each of the m micro-batches in turn, outputs concatenated "
                        "(the pipeline's compute without its machinery; checkpoint recomputation not included)",
        },
        "fit_model": "median_step(framework) - median_step(baseline) = fixed_us + per_task_us * n * m, "
                     "fits[baseline][checkpoint][framework]",
        "fits": fits,
        "targets": targets,
        "configs": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")


if __name__ == "__main__":
    main()
