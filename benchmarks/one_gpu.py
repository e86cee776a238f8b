"""One GPU, measured (issue 21): fxpipe on one device against what a one-GPU user runs today.

All rows in one process, on one device, each on its own deep copy of the same weights
(``benchmarks/_one_gpu_rows.py`` defines them): eager; eager with gradient accumulation over
the same ``--chunks`` micro-batches; eager + HF gradient checkpointing; ``torch.compile``
(default mode; ``mode='reduce-overhead'`` with accumulation over the micro-batches, issue 21's
CUDA-graphs floor, and whole batch); fxpipe pipelines of 4 stages on the one device
(``balance_by='params'``) at several chunks and checkpoint modes, uncompiled, ``compile=True``
and ``compile={'mode': 'reduce-overhead'}``.

Models: ``--model gpt2`` (transformers ``GPT2LMHeadModel``, the 124M config, batch 16 x 1024)
and ``--model llama1b`` (``LlamaForCausalLM``, hidden 2048, 16 layers, vocab 32000, 0.94B
parameters, batch 8 x 2048); ``--quick``: tiny configs of both (seconds on a CPU). Dropout
off, training mode. The loss is cross entropy outside the model. On CUDA every row runs under
bf16 autocast (``--autocast``) with float32 matmuls at full precision (TF32 off, ``--tf32`` on).

Per row, one after another (so that the 1B model's rows need not all fit at once): build,
``--warmup`` steps (compilation and CUDA-graph recording happen there), then one step whose
loss, logits and every gradient are compared with eager's (``tests/exact.py``'s policy:
``rtol * |expected| + max(atol, scale * magnitude)``, its ``BF16`` tolerance under autocast);
a row that is not exact is reported as failed and not timed. Then ``--steps`` timed steps
(gradients set to None before each, outside the timed region; ``torch.cuda.synchronize``
around each); the table shows the median. Peak memory: on CUDA the largest
``torch.cuda.max_memory_allocated`` over the timed steps minus what was allocated before the
step (weights, and the eager reference kept for the checks: the gradients a step makes are
counted); on CPU one more step under ``benchmarks/_memory.py``'s profiler meter. A row whose
build or step raises (a typed fxpipe refusal, an inductor crash, out of memory) is reported
with its error, and the next row runs.

Usage::

    python benchmarks/one_gpu.py --quick                          # CPU smoke run, both tiny models
    python benchmarks/one_gpu.py --device cuda --model gpt2       # issue 21's first table
    python benchmarks/one_gpu.py --device cuda --model llama1b    # its second table
    python benchmarks/one_gpu.py --device cuda --model gpt2 --rows eager accum pipe:4:never:ro
    python benchmarks/one_gpu.py --device cuda --model llama1b --profile prof   # issue 21 §0
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpipe  # noqa: E402
import _one_gpu_rows as R  # noqa: E402
from _device import add_device_argument, check_device, first_device, label, timed  # noqa: E402
from _memory import Meter  # noqa: E402
from _one_gpu_floor import floor_row, print_floors  # noqa: E402
from _one_gpu_goals import goals, print_goals  # noqa: E402
from _results import header, write_json  # noqa: E402


def autocast(a: argparse.Namespace, device: torch.device) -> Any:
    if a.autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def measure(runner: R.Runner, ids: torch.Tensor, targets: torch.Tensor, a: argparse.Namespace,
            device: torch.device) -> Dict[str, Any]:
    """Median step time and peak memory of ``--steps`` timed steps."""
    times: List[float] = []
    peak = 0
    for _ in range(a.steps):
        runner.zero()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times.append(timed(device.type, lambda: runner.step(ids, targets)))
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
    if device.type != "cuda":
        runner.zero()
        gc.collect()
        peak = Meter(device).run(lambda: runner.step(ids, targets))["peak_bytes"]
    return {"median_s": statistics.median(times), "times_s": times, "peak_bytes": peak}


def run_row(key: str, master: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, a: argparse.Namespace,
            device: torch.device, ref: Optional[tuple], floors: Dict[int, Any]) -> tuple:
    """One row: build, warm up, check against ``ref`` (eager's; None: this row is eager), time."""
    row: Dict[str, Any] = {"key": key, "label": R.label(key, a.chunks)}
    runner: Optional[R.Runner] = None
    print(f"{key}: {row['label']}", file=sys.stderr, flush=True)
    try:
        with autocast(a, device):
            t0 = time.perf_counter()
            runner = R.build(key, master, ids, a.chunks, device)
            row["build_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(max(a.warmup, 2) if runner.graphs or key.endswith(":ro") else a.warmup):
                runner.zero()
                runner.step(ids, targets)
            row["warmup_s"] = time.perf_counter() - t0
            runner.zero()
            loss, logits = runner.step(ids, targets, keep=True)
            got = (loss, logits, runner.grads())
            if ref is None:
                ref = got
            row["check"] = c = R.check(got, ref, a.autocast == "bf16", R.is_compiled(key))
            del got, loss, logits
            if not c["exact"]:
                row["status"] = f"failed: not exact: {c['worst_in']} differs by {c['worst_over_allowed']:.3g} times " \
                                "the allowed difference"
            else:
                row.update(measure(runner, ids, targets, a, device))
                row["status"] = "ok"
                if a.floor and key.startswith("pipe:") and not R.is_compiled(key):
                    try:
                        row["floor"] = floor_row(runner, key, ids, targets, device, floors)
                    except Exception as e:  # the row's times stand; its floor is reported as failed
                        row["floor"] = {"error": "floor failed: " + first_line(e)}
                        print(traceback.format_exc(), file=sys.stderr, flush=True)
    except Exception as e:  # reported in the row; the next row runs
        refused = isinstance(e, fxpipe.errors.FxpipeError)
        row["status"] = ("refused: " if refused else "failed: ") + first_line(e)
        row["traceback"] = traceback.format_exc()[-6000:]
        print(row["traceback"], file=sys.stderr, flush=True)
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                runner.close()
        del runner
        if R.is_compiled(key):
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  {row['status']}" + (f", {1e3 * row['median_s']:.1f} ms, peak {row['peak_bytes'] / 2**20:.1f} MiB"
                                  if "median_s" in row else ""), file=sys.stderr, flush=True)
    return row, ref


def table_header(caption: str, gib: bool) -> None:
    print()
    print(caption)
    print(f"| run | step s | peak {'GiB' if gib else 'MiB'} | step time / eager | peak memory / eager "
          "| check: worst error / allowed | status |")
    print("|---|--:|--:|--:|--:|--:|---|", flush=True)


def table_row(r: Dict[str, Any], eager: Dict[str, Any], gib: bool) -> None:
    """One row, printed as soon as it is measured (a run cut short keeps its rows)."""
    div = 2**30 if gib else 2**20
    check = f"{r['check']['worst_over_allowed']:.3f}" if "check" in r else ""
    status = r["status"].replace("|", "/").replace("\n", " ")
    if "median_s" not in r:
        print(f"| {r['label']} | | | | | {check} | **{status}** |", flush=True)
        return
    ratios = (f"{r['median_s'] / eager['median_s']:.3f} | {r['peak_bytes'] / eager['peak_bytes']:.3f}"
              if "median_s" in eager and eager["peak_bytes"] else " | ")
    print(f"| {r['label']} | {r['median_s']:.4f} | {r['peak_bytes'] / div:.2f} | {ratios} | {check} | {status} |",
          flush=True)


def run_model(name: str, a: argparse.Namespace, device: torch.device, doc: Dict[str, Any]) -> Dict[str, Any]:
    spec = R.model_spec(name, a.quick)
    keys = R.row_keys(name, a.rows, a.quick, device)
    for k in keys:
        if k.startswith("pipe:") and spec.batch % R.parse_pipe(k)[0]:
            raise SystemExit(f"row {k}: batch {spec.batch} is not a multiple of its chunks")
    torch.manual_seed(0)
    with torch.device(device):
        master = spec.make().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g).to(device)
    targets = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g).to(device)
    params = sum(p.numel() for p in master.parameters())
    what = (f"{type(master).__name__} {params / 1e6:.1f}M parameters, batch {spec.batch} x {spec.seq}, "
            f"{'bf16 autocast' if a.autocast == 'bf16' else 'float32'}, TF32 {'on' if a.tf32 else 'off'}")
    result: Dict[str, Any] = {"model": name, "description": what, "params": params, "rows": []}
    doc["models"].append(result)
    ref, gib, floors = None, device.type == "cuda", {}
    for key in keys:
        row, ref = run_row(key, master, ids, targets, a, device, ref, floors)
        result["rows"].append(row)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))  # after every row: a run cut short keeps its rows
        eager = result["rows"][0]
        if key == "eager":
            measured = ""
            if "median_s" in eager:
                size = f"{eager['peak_bytes'] / 2**30:.2f} GiB" if gib else f"{eager['peak_bytes'] / 2**20:.2f} MiB"
                measured = f"; eager {eager['median_s']:.4f} s, {size}"
            table_header(f"{what}; {R.STAGES} fxpipe stages on {label(device.type)}; medians of {a.steps} steps "
                         f"after {a.warmup} warm-up{measured}:", gib)
        table_row(row, eager, gib)
        if key == "eager" and ref is None:
            print(f"eager failed ({row['status']}): no reference to check the other rows against", file=sys.stderr)
            break
    result["goals"] = goals(result["rows"], a.chunks)
    print_goals(name, result["goals"])
    print_floors(name, result["rows"], gib)
    if a.profile:
        from _one_gpu_profile import profile_pipe
        with autocast(a, device):
            result["profile"] = profile_pipe(master, ids, targets, device, a.profile, name, a.warmup)
    del master, ref
    gc.collect()
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(p, "every row runs on that one device")
    p.add_argument("--model", nargs="+", default=None, choices=["gpt2", "llama1b"],
                   help="default: gpt2 (with --quick: both)")
    p.add_argument("--rows", nargs="+", default=None,
                   help="row keys (see benchmarks/_one_gpu_rows.py), e.g. eager accum hf_ckpt compiled ro_accum ro "
                        "pipe:4:never pipe:4:never:compile pipe:4:never:ro, or the groups all, uncompiled, compiled; "
                        "default: all for gpt2, uncompiled for llama1b and for --quick on the CPU")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches of the accumulation rows (default 4)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto",
                   help="auto: bf16 on CUDA, none on CPU")
    p.add_argument("--tf32", action="store_true", help="float32 matmuls in TF32 (default: off)")
    p.add_argument("--quick", action="store_true", help="tiny configs, 3 timed steps: a smoke run")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile one fxpipe chunks=1 'never' step (torch.profiler) into DIR")
    p.add_argument("--floor", action="store_true",
                   help="also each uncompiled pipeline row's peak against its activation-memory floor (_floor.py)")
    p.add_argument("--out", default=None, help="JSON result (default benchmarks/results/one_gpu_<device>.json)")
    a = p.parse_args(argv)
    check_device(a.device)
    device = first_device(a.device)
    if a.autocast == "auto":
        a.autocast = "bf16" if device.type == "cuda" else "none"
    if a.quick:
        a.steps, a.warmup = min(a.steps, 3), min(a.warmup, 1)
    a.model = a.model or (["gpt2", "llama1b"] if a.quick else ["gpt2"])
    a.out = a.out or str(HERE / "results" / f"one_gpu_{a.device}.json")
    torch.set_float32_matmul_precision("high" if a.tf32 else "highest")
    doc = {**header("one_gpu", a.device, label=label(a.device)), "command": " ".join(["benchmarks/one_gpu.py",
           *(argv if argv is not None else sys.argv[1:])]), "config": vars(a), "models": []}
    t0 = time.perf_counter()
    for name in a.model:
        run_model(name, a, device, doc)
    doc["seconds"] = time.perf_counter() - t0
    failed = [f"{m['model']} {r['key']}" for m in doc["models"] for r in m["rows"] if r["status"] != "ok"]
    print(f"\n{len(failed)} row(s) not ok: {', '.join(failed) or 'none'}; {doc['seconds']:.0f} s")
    write_json(a.out, doc)


if __name__ == "__main__":
    main()
