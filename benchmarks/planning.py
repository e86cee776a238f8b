"""Planning time and memory: ``fxpipe.pipeline(...)`` against one eager training step.

Issue 12, part 1: a build should cost about what the user already pays for one training
step on the sample. Per model, in one process and interleaved (the machine is shared, so
contenders alternate and medians are reported):

* ``eager``: one forward + backward of the sample (``out.sum().backward()``), after one
  untimed warm-up step (and one untimed ``'params'`` build: a process's first build also
  imports torch.export / torch._dynamo, seconds that a second build does not pay; both
  first runs are in the JSON);
* ``build params``: ``fxpipe.pipeline(model, sample, 4, chunks=2, balance_by='params',
  progress=False)``;
* ``build time``: the same with ``balance_by='time'`` (profiled, one micro-batch).

Goals: ``'time'`` build <= 1.5x one eager step; ``'params'`` build <= 0.3x one eager step;
a build's peak memory no higher than the eager step's.

Memory: on ``--device cpu`` the process's peak RSS during each call (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``: the real footprint, whatever allocated it),
and that peak over the RSS just before the call (what the call itself added); on
``--device cuda`` ``torch.cuda.max_memory_allocated`` during the call, and over the
allocation before it. The build's phases
(capture, checks, profile, partition, emit) are timed from the ``"fxpipe"`` logger's records.

Models (``--small`` shrinks GPT-2's width to 128 for a quick run):

* ``gpt2-12``: transformers ``GPT2LMHeadModel``, 12 layers (GPT-2 124M), batch 2 x 128 tokens;
* ``gpt2-48``: the same with 48 layers (380M);
* ``chain-20k``: ``nn.Sequential`` of 10,000 ``Linear(8, 8)`` + ``ReLU`` pairs, batch 4
  (20,002 fx nodes): the per-node costs of planning.

Usage::

    .venv/bin/python benchmarks/planning.py                       # all models, writes results/planning.json
    .venv/bin/python benchmarks/planning.py --models gpt2-12 chain-20k --repeat 3
    .venv/bin/python benchmarks/planning.py --device cuda
"""

from __future__ import annotations

import argparse
import gc
import logging
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from _results import header, write_json  # noqa: E402
from _device import add_device_argument, check_device, first_device, stage_devices, synchronize  # noqa: E402

N_STAGES, CHUNKS = 4, 2
MODELS = ("gpt2-12", "gpt2-48", "chain-20k")


def make_model(name: str, small: bool, device: torch.device) -> Tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(0)
    if name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        layers = int(name.split("-")[1])
        width = dict(n_embd=128, n_head=4) if small else {}
        cfg = GPT2Config(n_layer=layers, use_cache=False, **width)
        model = GPT2LMHeadModel(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (2, 128), device=device)
        params = sum(p.numel() for p in model.parameters())
        return model, x, f"GPT-2, {layers} layers, width {cfg.n_embd}, {params / 1e6:.0f}M parameters, batch 2 x 128"
    if name == "chain-20k":
        layers: List[nn.Module] = []
        for _ in range(10_000):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        return nn.Sequential(*layers).to(device), torch.randn(4, 8, device=device), "chain of 10,000 Linear(8, 8) + ReLU, batch 4"
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _loss(out: Any) -> torch.Tensor:
    t = out.logits if hasattr(out, "logits") else out
    return t.float().sum()


class PeakMemory:
    """Peak memory of one call over what was in use just before it (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def _status(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]

    def run(self, fn: Callable[[], Any]) -> Tuple[Any, int, int]:
        """(fn(), peak bytes during the call, peak bytes over those in use before it)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            out = fn()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return out, peak, peak - base
        base = self._status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        out = fn()
        peak = self._status("VmHWM")
        return out, peak, peak - base


class PhaseLog(logging.Handler):
    """Seconds of each build phase, from fxpipe.progress's 'took' records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.phases: Dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "fxpipe: %s took %.2fs":
            name, seconds = record.args  # type: ignore[misc]
            self.phases[str(name)] = self.phases.get(str(name), 0.0) + float(seconds)


def measure(name: str, repeat: int, small: bool, device_name: str) -> Dict[str, Any]:
    device = first_device(device_name)
    model, x, what = make_model(name, small, device)
    model.train()
    meter = PeakMemory(device)
    log = PhaseLog()
    logger = logging.getLogger("fxpipe")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)

    def sync() -> None:
        synchronize(device_name)

    def eager() -> None:
        _loss(model(x)).backward()
        model.zero_grad(set_to_none=True)

    def build(balance_by: str) -> Callable[[], Any]:
        return lambda: fxpipe.pipeline(model, x, N_STAGES, chunks=CHUNKS, balance_by=balance_by, progress=False,
                                       devices=stage_devices(device_name, N_STAGES))

    t0 = time.perf_counter()
    eager()  # warm-up: one-time set-up is not billed to the timed step
    sync()
    first_step = time.perf_counter() - t0
    t0 = time.perf_counter()
    build("params")().close()  # warm-up: the process's first build imports torch.export/dynamo (seconds)
    first_build = time.perf_counter() - t0
    runs: Dict[str, List[float]] = {"eager": [], "params": [], "time": []}
    peaks: Dict[str, List[int]] = {"eager": [], "params": [], "time": []}
    added: Dict[str, List[int]] = {"eager": [], "params": [], "time": []}
    phases: Dict[str, List[Dict[str, float]]] = {"params": [], "time": []}
    costs: Dict[str, Any] = {}
    for r in range(repeat):
        for key, fn in (("eager", eager), ("params", build("params")), ("time", build("time"))):
            log.phases = {}
            t0 = time.perf_counter()
            out, peak, more = meter.run(fn)
            sync()
            runs[key].append(time.perf_counter() - t0)
            peaks[key].append(peak)
            added[key].append(more)
            if key != "eager":
                phases[key].append(dict(log.phases))
                costs[key] = {k: v for k, v in out.plan.meta.get("costs", {}).items() if k != "reused_from"}
                costs[key]["nodes"] = out.plan.meta.get("nodes")
                out.close()
            del out
            print(f"# {name} {key} run {r + 1}: {runs[key][-1]:.2f}s, peak {peak / 2**20:.0f} MiB "
                  f"(+{more / 2**20:.0f} MiB)", file=sys.stderr)
    logger.removeHandler(log)
    med = {k: statistics.median(v) for k, v in runs.items()}
    peak_med = {k: statistics.median(v) for k, v in peaks.items()}
    added_med = {k: statistics.median(v) for k, v in added.items()}
    phase_med = {k: {ph: statistics.median(p.get(ph, 0.0) for p in v) for ph in v[0]} for k, v in phases.items()}
    return {
        "model": name, "what": what, "repeat": repeat, "first_eager_step_s": first_step,
        "first_build_params_s": first_build,
        "seconds": runs, "median_s": med,
        "ratio_params": med["params"] / med["eager"], "ratio_time": med["time"] / med["eager"],
        "peak_bytes": peaks, "median_peak_bytes": peak_med, "added_bytes": added, "median_added_bytes": added_med,
        "peak_ratio_params": peak_med["params"] / peak_med["eager"],
        "peak_ratio_time": peak_med["time"] / peak_med["eager"],
        "phases_s": phase_med, "costs": costs,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (eager, params, time) per model")
    p.add_argument("--small", action="store_true", help="GPT-2 at width 128 (quick run)")
    add_device_argument(p, "the model, its sample and the eager step on cuda:0")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planning.json"))
    a = p.parse_args(argv)
    check_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    began = time.perf_counter()
    rows = [measure(m, a.repeat, a.small, a.device) for m in a.models]
    print("| model | eager step | build params | build time | params / eager | time / eager "
          "| peak eager | peak params | peak time |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    mib = lambda r, k: f"{r['median_peak_bytes'][k] / 2**20:.0f} (+{r['median_added_bytes'][k] / 2**20:.0f}) MiB"  # noqa: E731
    for r in rows:
        m = r["median_s"]
        print(f"| {r['what']} | {m['eager']:.2f} s | {m['params']:.2f} s | {m['time']:.2f} s | "
              f"{r['ratio_params']:.2f}x | {r['ratio_time']:.2f}x | {mib(r, 'eager')} | {mib(r, 'params')} | "
              f"{mib(r, 'time')} |")
    for r in rows:
        for key, ph in r["phases_s"].items():
            print(f"# {r['model']} {key} phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in ph.items()))
    result = {
        **header("planning", a.device, threads=torch.get_num_threads()),
        "command": "benchmarks/planning.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "n_stages": N_STAGES, "chunks": CHUNKS, "goals": {"time": 1.5, "params": 0.3, "peak": 1.0},
        "seconds": time.perf_counter() - began,
        "rows": rows,
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
