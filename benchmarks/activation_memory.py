"""Activation memory of a pipelined training step against its floor (U-Net and GPT).

For each model, chunks ``m`` and checkpoint mode, one training step of
``fxpipe.pipeline(model, x, 4, chunks=m, checkpoint=mode)`` (every stage on one device: one
memory pool) is measured and compared with the **floor**: the least memory any GPipe
implementation needs for that step, computed from measured quantities of the same stages
(``benchmarks/_floor.py`` derives it)::

    never       : max_p  (m-1) * a_{<=p} + E_p
    except_last : max_p  (m-1) * s_{<=p} + E_p
    always      : max_p      m * s_{<=p} - s_p + E'_p

with, per micro-batch of ``b = B / m`` samples and per stage ``j``: ``s_j`` the bytes of the
distinct tensors stage ``j`` receives (its arguments and the portal values it pops, which a
checkpointed task keeps for its recomputation), ``a_j`` the bytes its forward saves for
backward; ``E_p`` the peak, during stage ``p``'s backward, of one eager step of the last
micro-batch through the stages (the step's loss over the merged output of all ``B`` samples,
the other micro-batches' output gradients held until its last stage's backward is done);
``E'_p`` the peak of stage ``p``'s recomputation and backward alone (its own inputs
included). ``x_{<=p}`` sums stages ``0..p``. Why each is a floor: while the last micro-batch's
backward runs on stage ``p``, GPipe's order (data, and micro-batch ``i-1`` after ``i`` on each
stage) guarantees that no other micro-batch has run its backward on stages ``<= p``: their
boundary inputs (checkpointed) or saved activations (not) are still needed, hence held.

Models (activations dominate parameters): ``tests/zoo.py``'s ``UNet(c=16)`` on ``B x 3 x 64 x 64``
(long skips carried by portals), and ``TinyGPT(vocab=64, d=64, heads=4, layers=8, ctx=64)`` on
``B x 64`` tokens; ``B = 32`` so that ``m`` = 1, 4, 8 and 32 divide it. One plan per model
(``balance_by='memory'``: deterministic), reused for every chunks and mode.

One *step* is ``out = model(x); out.float().pow(2).mean().backward()`` (``out`` held during
backward, as a user's variable is). Each contender runs one warm-up step first (gradients
then exist and are zeroed in place, so the measured step allocates activations and
temporaries, not ``.grad`` tensors), then one measured step. The floor's parts are measured
the same way, after the same warm-up.

Peak memory (``benchmarks/_memory.py``): CPU, the profiler's raw allocator records, running
sum, maximum; CUDA (``--device cuda``), ``torch.cuda.max_memory_allocated`` minus the
allocation before the step, every stage on ``cuda:0``. Phases of ``E_p`` are cut by marks
(an allocation of an odd size on CPU, a peak-statistics reset on CUDA) made by gradient hooks.

Usage::

    .venv/bin/python benchmarks/activation_memory.py                   # CPU, both models
    .venv/bin/python benchmarks/activation_memory.py --device cuda     # one GPU
    .venv/bin/python benchmarks/activation_memory.py --models unet --chunks 8 --modes except_last
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
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from zoo import TinyGPT, UNet  # noqa: E402

import _floor as floor  # noqa: E402
from _memory import peak  # noqa: E402

torch.set_num_threads(1)
MIB = float(1 << 20)
MODES = ("never", "except_last", "always")


def loss(out: torch.Tensor) -> None:
    out.float().pow(2).mean().backward()


def step(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)  # held during backward, as a user's variable is
    loss(out)


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def build(name: str, a: argparse.Namespace, device: torch.device) -> Tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(0)
    if name == "unet":
        model: nn.Module = UNet(a.channels)
        x = torch.randn(a.batch, 3, a.size, a.size)
        what = f"UNet(c={a.channels}), input {a.batch}x3x{a.size}x{a.size}"
    else:
        model = TinyGPT(a.vocab, a.d, a.heads, a.layers, a.ctx)
        x = torch.randint(0, a.vocab, (a.batch, a.ctx))
        what = f"TinyGPT(vocab={a.vocab}, d={a.d}, heads={a.heads}, layers={a.layers}, ctx={a.ctx}), input {a.batch}x{a.ctx}"
    return model.to(device), x.to(device), what


def measure(model: nn.Module, x: torch.Tensor, device: torch.device) -> Dict[str, Any]:
    step(model, x)  # warm-up: .grad exists from now on
    zero_grads(model)
    gc.collect()
    t0 = time.perf_counter()
    res = peak(lambda: step(model, x), device)
    res["step_s_profiled"] = time.perf_counter() - t0
    res.pop("phases", None)
    return res


def floor_parts(pipe: Any, model: nn.Module, x: torch.Tensor, chunks: int, device: torch.device) -> Dict[str, Any]:
    """The floor's measured parts for ``chunks`` micro-batches, and each mode's floor."""
    stages = pipe.stages.modules
    flat = pipe.capture.flatten_inputs((x,), {})
    micro, sizes = pipe.batching.split(flat, chunks)
    exclude = {floor.storage_key(t) for t in [*model.parameters(), *model.buffers(), *floor.tensors(flat)]}
    leaves = micro[-1]

    def merge(outputs: List[List[Any]]) -> Any:
        return pipe.capture.unflatten_output(pipe.batching.merge(outputs, sizes))

    received = floor.received_bytes(stages, leaves, exclude)
    saved = floor.saved_bytes(stages, leaves, exclude)
    with torch.no_grad():
        ios = floor.walk(stages, leaves)
    rest = [ios[-1].output] * (len(micro) - 1)  # made before the step: not counted, as the floor says
    gc.collect()
    phases = floor.last_micro_batch_phases(stages, leaves, rest, merge, loss, device)
    alone = floor.stage_alone_peaks(stages, ios, rest, merge, loss, exclude, device)
    return {"micro_batches": len(micro), "micro_batch_size": sizes[-1], "received_bytes": received,
            "saved_bytes": saved, "last_micro_batch_phases": phases, "stage_alone_peak_bytes": alone,
            "floors": floor.floors(len(micro), received, saved, phases, alone)}


def run_model(name: str, a: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    model, x, what = build(name, a, device)
    devices = [device] * a.stages
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    eager = measure(model, x, device)
    model.zero_grad(set_to_none=True)
    plan = fxpipe.pipeline(model, x, a.stages, chunks=1, devices=devices, balance_by=a.balance_by).plan
    rows: List[Dict[str, Any]] = []
    for chunks in a.chunks:
        if a.batch % chunks:
            raise SystemExit(f"--batch {a.batch} is not a multiple of chunks {chunks}: micro-batches must be equal")
        parts: Optional[Dict[str, Any]] = None
        for mode in a.modes:
            pipe = fxpipe.pipeline(model, x, a.stages, chunks=chunks, devices=devices, checkpoint=mode, plan=plan)
            try:
                row = measure(pipe, x, device)
                if parts is None:
                    parts = floor_parts(pipe, model, x, chunks, device)
            finally:
                pipe.close()  # its worker threads end while the interpreter is fully alive
            best = parts["floors"][mode]
            row.update(model=name, chunks=chunks, checkpoint=mode, micro_batch=parts["micro_batch_size"],
                       floor_bytes=best["floor_bytes"], floor_phase=best["phase"], floor_held_bytes=best["held_bytes"],
                       floor_last_bytes=best["last_bytes"], ratio=row["peak_bytes"] / best["floor_bytes"])
            rows.append(row)
            del pipe
            gc.collect()
        assert parts is not None
        parts.pop("floors")
        rows[-1]["floor_parts"] = parts
    return {"model": name, "description": what, "param_bytes": params, "eager": eager,
            "stages": len(plan.stages), "rows": rows}


def print_table(result: Dict[str, Any], device: str, stages: int) -> None:
    print(f"\n{result['description']}, params {result['param_bytes'] / MIB:.2f} MiB, {stages} stages on {device}; "
          f"eager step peak {result['eager']['peak_bytes'] / MIB:.1f} MiB")
    print("| chunks | checkpoint | fxpipe peak MiB | floor MiB | peak / floor | floor set in | held MiB | "
          "last micro-batch MiB |")
    print("|--:|---|--:|--:|--:|---|--:|--:|")
    for r in result["rows"]:
        where = "forward" if r["floor_phase"] < 0 else f"stage {r['floor_phase']} backward"
        print(f"| {r['chunks']} | {r['checkpoint']} | {r['peak_bytes'] / MIB:.2f} | {r['floor_bytes'] / MIB:.2f} | "
              f"{r['ratio']:.3f} | {where} | {r['floor_held_bytes'] / MIB:.2f} | {r['floor_last_bytes'] / MIB:.2f} |")


def parse_model_arguments(p: argparse.ArgumentParser, argv: Optional[Sequence[str]],
                          chunks: List[int]) -> Tuple[argparse.Namespace, torch.device]:
    """The models, their sizes and the configurations, shared with ``order_memory.py``; the
    parsed arguments and the device."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", nargs="+", default=["unet", "gpt"], choices=["unet", "gpt"])
    p.add_argument("--chunks", nargs="+", type=int, default=chunks)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--balance-by", default="memory", choices=["memory", "time", "params"])
    p.add_argument("--size", type=int, default=64, help="U-Net input height = width")
    p.add_argument("--channels", type=int, default=16, help="U-Net base channels")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d", type=int, default=64, help="GPT width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64, help="GPT sequence length")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    return a, torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a, device = parse_model_arguments(p, argv, chunks=[1, 4, 8, 32])
    t0 = time.perf_counter()
    results = []
    for name in a.models:
        result = run_model(name, a, device)
        print_table(result, a.device, a.stages)
        results.append(result)
    worst = max(r["ratio"] for res in results for r in res["rows"])
    print(f"\nworst peak / floor: {worst:.3f} (goal <= 1.15); {time.perf_counter() - t0:.0f} s")
    below = [f"{res['model']} chunks {r['chunks']} {r['checkpoint']}" for res in results for r in res["rows"]
             if r["ratio"] < 0.995]
    if below:  # a floor is a lower bound: a measured peak under it means its derivation missed something
        print(f"WARNING: measured below the floor in {', '.join(below)}: the floor is not a floor there")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"activation_memory_{a.device}.json"
    doc = {
        "benchmark": "activation_memory",
        "date": _dt.date.today().isoformat(),
        "command": " ".join(["benchmarks/activation_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "cuda": torch.cuda.get_device_name(0) if a.device == "cuda" else None},
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "worst_ratio": worst,
        "models": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
