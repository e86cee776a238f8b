"""Compiled stages: ``fxpipe.pipeline(..., compile=True)`` against the uncompiled pipeline and
against ``torch.compile(model)`` run eagerly (issue #12, part 2).

Models: ``tests/zoo.py``'s ``TinyGPT`` (tied embedding; ``--gpt-d`` wide, ``--gpt-layers``
blocks, context 64) and ``UNet`` (long skips become portals). One *step* is
``out = model(x); out.float().pow(2).mean().backward()`` with gradients zeroed in place
outside the timed region. Contenders, each on its own copy of the same weights:

* **eager**: the model; **compiled eager**: ``torch.compile(model)`` (inductor);
* **pipe**: ``fxpipe.pipeline(model, x, stages, chunks=m, devices=[device] * stages)``;
* **pipe compiled**: the same with ``compile=True`` (each stage through inductor).

Before timing, every contender's output and gradients are compared with eager's
(``torch.testing.assert_close``, rtol 1e-3, atol 1e-4: inductor reassociates and fuses sums). Each contender
gets ``--warmup`` steps (compilation happens there: the last micro-batch may have another
shape, so every stage compiles once per distinct micro-batch shape), then the timed steps
visit the contenders in a rotating order, ``--repeat`` rounds; the table shows medians.
The goal is ``pipe compiled / compiled eager <= 1.05`` at chunks=1: the stage boundaries cost
graph breaks (each stage is its own compiled graph), and the runtime adds its per-task cost.

Usage::

    .venv/bin/python benchmarks/compiled.py                  # CPU, 1 torch thread
    .venv/bin/python benchmarks/compiled.py --quick          # smoke: small, 3 rounds
    .venv/bin/python benchmarks/compiled.py --device cuda    # one GPU, every stage on it
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import fxpipe  # noqa: E402
from zoo import TinyGPT, UNet  # noqa: E402

torch.set_num_threads(1)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_models(a: argparse.Namespace, device: torch.device) -> Dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=512, d=a.gpt_d, heads=4, layers=a.gpt_layers, ctx=64).to(device)
    idx = torch.randint(0, 512, (a.batch, 64), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    unet = UNet(a.unet_channels).to(device)
    img = torch.randn(a.batch, 3, a.unet_size, a.unet_size, generator=torch.Generator().manual_seed(2)).to(device)
    return {"gpt": (gpt, idx), "unet": (unet, img)}


def contenders(model: nn.Module, x: torch.Tensor, a: argparse.Namespace, chunks: int,
               device: torch.device) -> Dict[str, nn.Module]:
    devices = [device] * a.stages
    made: Dict[str, nn.Module] = {"eager": copy.deepcopy(model)}
    made["compiled eager"] = torch.compile(copy.deepcopy(model))
    made["pipe"] = fxpipe.pipeline(copy.deepcopy(model), x, a.stages, chunks=chunks, devices=devices,
                                   balance_by="params", checkpoint=a.checkpoint)
    made["pipe compiled"] = fxpipe.pipeline(copy.deepcopy(model), x, a.stages, chunks=chunks, devices=devices,
                                            balance_by="params", checkpoint=a.checkpoint, compile=True)
    return made


def params_of(m: nn.Module) -> List[nn.Parameter]:
    inner = getattr(m, "_orig_mod", None) or getattr(m, "module", None) or m
    return list(inner.parameters())


def check_exact(made: Dict[str, nn.Module], x: torch.Tensor) -> Dict[str, float]:
    """Every contender's output and gradients against eager's; returns the max abs error."""
    outs, grads = {}, {}
    for name, m in made.items():
        out = m(x)
        loss_of(out).backward()
        outs[name] = out.detach()
        grads[name] = [p.grad.detach().clone() for p in params_of(m)]
        for p in params_of(m):
            p.grad = None
    errors = {}
    for name in made:
        torch.testing.assert_close(outs[name], outs["eager"], rtol=1e-3, atol=1e-4)
        for g, r in zip(grads[name], grads["eager"]):
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)
        errors[name] = max([(outs[name] - outs["eager"]).abs().max().item()]
                           + [(g - r).abs().max().item() for g, r in zip(grads[name], grads["eager"])])
    return errors


def step_fn(m: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    params = params_of(m)

    def run() -> None:
        loss_of(m(x)).backward()

    def zero() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    run.zero = zero  # type: ignore[attr-defined]
    return run


def time_rounds(made: Dict[str, nn.Module], x: torch.Tensor, a: argparse.Namespace,
                device: torch.device) -> Dict[str, List[float]]:
    steps = {name: step_fn(m, x) for name, m in made.items()}
    for name, run in steps.items():
        for _ in range(a.warmup):
            run()
            run.zero()  # type: ignore[attr-defined]
    times: Dict[str, List[float]] = {name: [] for name in made}
    names = list(made)
    for r in range(a.repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            steps[name].zero()  # type: ignore[attr-defined]
            synchronize(device)
            t0 = time.perf_counter()
            steps[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gpt-d", type=int, default=256)
    p.add_argument("--gpt-layers", type=int, default=8)
    p.add_argument("--unet-channels", type=int, default=16)
    p.add_argument("--unet-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--models", nargs="+", default=["gpt", "unet"])
    p.add_argument("--quick", action="store_true", help="small models, 3 rounds: a smoke run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.gpt_d, a.gpt_layers, a.unet_size, a.repeat, a.warmup = 4, 64, 4, 32, 3, 2
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    device = torch.device(a.device)
    rows: List[Dict[str, Any]] = []
    for model_name, (model, x) in make_models(a, device).items():
        if model_name not in a.models:
            continue
        for chunks in a.chunks:
            torch._dynamo.reset()
            made = contenders(model, x, a, chunks, device)
            try:
                errors = check_exact(made, x)
                times = time_rounds(made, x, a, device)
            finally:
                for m in made.values():
                    if isinstance(m, fxpipe.Pipeline):
                        m.close()
            med = {name: statistics.median(ts) for name, ts in times.items()}
            row = {"model": model_name, "chunks": chunks, "median_s": med,
                   "min_s": {n: min(ts) for n, ts in times.items()}, "max_abs_error": errors,
                   "pipe_compiled_over_compiled_eager": med["pipe compiled"] / med["compiled eager"],
                   "pipe_compiled_over_pipe": med["pipe compiled"] / med["pipe"],
                   "compiled_eager_over_eager": med["compiled eager"] / med["eager"]}
            rows.append(row)
            print(f"{model_name} chunks={chunks}: " + ", ".join(f"{n} {1e3 * v:.1f} ms" for n, v in med.items())
                  + f"; pipe compiled / compiled eager x{row['pipe_compiled_over_compiled_eager']:.3f}",
                  flush=True)

    print()
    print("| model | chunks | eager ms | compiled eager ms | pipe ms | pipe compiled ms "
          "| compiled pipe / compiled eager | compiled pipe / pipe |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m = r["median_s"]
        print(f"| {r['model']} | {r['chunks']} | {1e3 * m['eager']:.1f} | {1e3 * m['compiled eager']:.1f} "
              f"| {1e3 * m['pipe']:.1f} | {1e3 * m['pipe compiled']:.1f} "
              f"| {r['pipe_compiled_over_compiled_eager']:.3f} | {r['pipe_compiled_over_pipe']:.3f} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": _dt.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv, "args": vars(a),
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
