"""Activation memory of a U-Net pipeline: checkpoint='except_last' vs 'never' (and eager).

Model: ``tests/zoo.py``'s ``UNet`` with ``c=16`` base channels (enc 16/32/64, mid 64, long
skips enc -> dec concatenated), input ``16 x 3 x 64 x 64`` by default: parameters are ~0.4 MiB,
activations hundreds of MiB, so activations dominate. Pipelined with
``fxpipe.pipeline(model, x, 4, chunks=8, devices=[device] * 4, checkpoint=...)``.

One *step* is ``out = model(x); out.float().pow(2).mean().backward()``. Each contender runs
one warm-up step first (gradients then exist and are zeroed in place, so the measured step
allocates activations and temporaries, not ``.grad`` tensors), then one measured step.

Peak memory:

* CPU: ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` around the step.
  The profiler records one ``[memory]`` event per allocation (+bytes) and per free
  (-bytes) of the CPU allocator, on every thread (the pipeline computes on its worker
  thread; autograd backward on the caller's). Sorting those events by timestamp and
  taking the running sum gives the bytes allocated *during the step* at each moment; the
  peak is its maximum. Only ``[memory]`` events are summed (operator events carry the
  allocations of their children in ``cpu_memory_usage`` too, so summing them would double
  count). Sanity check: the running sum at the end (``end_bytes``) should be ~0, since
  everything a step allocates is freed once backward is done.
* CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` minus the allocation before
  the step, summed over the devices used (``reset_peak_memory_stats`` first).

Usage::

    .venv/bin/python benchmarks/activation_memory.py                 # CPU
    .venv/bin/python benchmarks/activation_memory.py --device cuda   # GPU(s)
    .venv/bin/python benchmarks/activation_memory.py --batch 8       # quicker
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
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
from zoo import UNet  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _memory import cpu_peak  # noqa: E402

torch.set_num_threads(1)
MIB = float(1 << 20)


def step(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)
    out.float().pow(2).mean().backward()


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def cuda_peak(fn: Callable[[], None], devices: List[torch.device]) -> Dict[str, Any]:
    uniq = sorted({d.index or 0 for d in devices})
    for i in uniq:
        torch.cuda.synchronize(i)
        torch.cuda.reset_peak_memory_stats(i)
    base = {i: torch.cuda.memory_allocated(i) for i in uniq}
    fn()
    for i in uniq:
        torch.cuda.synchronize(i)
    peak = sum(torch.cuda.max_memory_allocated(i) - base[i] for i in uniq)
    end = sum(torch.cuda.memory_allocated(i) - base[i] for i in uniq)
    return {"peak_bytes": peak, "end_bytes": end, "how": "sum over devices of cuda max_memory_allocated - allocated before"}


def measure(name: str, model: nn.Module, x: torch.Tensor, device: torch.device, devices: List[torch.device]) -> Dict[str, Any]:
    step(model, x)  # warm-up: .grad exists from now on
    zero_grads(model)
    gc.collect()
    t0 = time.perf_counter()
    if device.type == "cuda":
        res = cuda_peak(lambda: step(model, x), devices)
    else:
        res = cpu_peak(lambda: step(model, x))
    res["step_s_profiled"] = time.perf_counter() - t0
    res["contender"] = name
    return res


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64, help="input height = width")
    p.add_argument("--channels", type=int, default=16, help="UNet base channels")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    device = torch.device(a.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        devices = [torch.device("cuda", i % count) for i in range(a.stages)]
    else:
        devices = [device] * a.stages

    torch.manual_seed(0)
    model = UNet(a.channels).to(devices[0])
    x = torch.randn(a.batch, 3, a.size, a.size, device=devices[0])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: List[Dict[str, Any]] = []
    rows.append(measure("eager", model, x, device, devices[:1]))
    for mode in ("never", "except_last"):
        model.zero_grad(set_to_none=True)
        pipe = fxpipe.pipeline(model, x, a.stages, chunks=a.chunks, devices=devices, checkpoint=mode,
                               balance_by="time")
        try:
            row = measure(f"fxpipe {mode}", pipe, x, device, devices)
            row["plan_stage_costs_s"] = [s.cost for s in pipe.plan.stages]
        finally:
            pipe.close()  # its worker threads end while the interpreter is fully alive (see overhead.py)
        rows.append(row)
        del pipe
        gc.collect()

    by = {r["contender"]: r for r in rows}
    ratio = by["fxpipe except_last"]["peak_bytes"] / by["fxpipe never"]["peak_bytes"]
    print(f"UNet(c={a.channels}), input {a.batch}x3x{a.size}x{a.size}, params {params / MIB:.2f} MiB, "
          f"{a.stages} stages on {a.device}, chunks {a.chunks}")
    print("| contender | peak MiB | vs never | end MiB | step s (profiled) |")
    print("|---|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['contender']} | {r['peak_bytes'] / MIB:.1f} | "
              f"{r['peak_bytes'] / by['fxpipe never']['peak_bytes']:.3f} | {r['end_bytes'] / MIB:.1f} | "
              f"{r['step_s_profiled']:.2f} |")
    print(f"ratio except_last / never: {ratio:.3f}")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"activation_memory_{a.device}.json"
    result = {
        "benchmark": "activation_memory",
        "date": _dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "cuda": torch.cuda.get_device_name(0) if a.device == "cuda" else None},
        "config": {"model": f"zoo.UNet(c={a.channels})", "input": [a.batch, 3, a.size, a.size], "stages": a.stages,
                   "chunks": a.chunks, "device": a.device, "param_bytes": params},
        "ratio_except_last_over_never": ratio,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
