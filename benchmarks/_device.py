"""``--device cpu|cuda`` for the benchmarks: one meaning of it, in one place.

- Stage placement: on CPU ``['cpu'] * n``; on CUDA with one GPU ``['cuda:0'] * n`` (one GPU
  split into n stages: its stages share the GPU's compute stream, so they do not run in
  parallel, but copies, recomputation and the runtime's bookkeeping are what a GPU run
  costs); with several GPUs, contiguous stages per GPU (``cuda:{j * count // n}``).
- Timing: wall time around the call, with ``torch.cuda.synchronize()`` before and after on
  CUDA so that queued kernels count (the pipeline's worker threads and copy streams make
  per-stream CUDA events miss work; a full synchronize does not).
- Memory: ``torch.cuda.max_memory_allocated`` over the call, minus what was allocated
  before it (all devices used, summed); ``None`` on CPU, where benchmarks that report memory
  use ``_memory.py``.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any, Callable, Dict, List, Optional

import torch

CHOICES = ("cpu", "cuda")


def add_device_argument(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``--device cpu|cuda`` (default cpu); ``what`` says what the device changes, for --help."""
    parser.add_argument(
        "--device", default="cpu", choices=CHOICES,
        help="where the pipeline's stages run: cpu (['cpu'] * n) or cuda (one GPU split into n stages, "
             "or contiguous stages per GPU when there are several)" + (f"; {what}" if what else ""),
    )


def check_device(device: str) -> None:
    """Exits with a clear message when ``--device cuda`` is asked for without a GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")


def stage_devices(device: str, n: int) -> List[str]:
    """The ``devices=`` list for an n-stage pipeline (see the module docstring)."""
    if device != "cuda":
        return ["cpu"] * n
    count = torch.cuda.device_count()
    return [f"cuda:{j * count // n}" for j in range(n)]


def first_device(device: str) -> torch.device:
    """Where the model's input and the eager reference live."""
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def synchronize(device: str) -> None:
    if device == "cuda":
        for k in range(torch.cuda.device_count()):
            torch.cuda.synchronize(k)


def timed(device: str, fn: Callable[[], Any]) -> float:
    """Seconds for ``fn()``, including the GPU work it queued."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def peak_bytes(device: str, fn: Callable[[], Any]) -> Optional[int]:
    """Peak CUDA memory allocated during ``fn()`` above what was allocated before, summed
    over the GPUs; ``None`` on CPU."""
    if device != "cuda":
        fn()
        return None
    gpus = range(torch.cuda.device_count())
    synchronize(device)
    base = [torch.cuda.memory_allocated(k) for k in gpus]
    for k in gpus:
        torch.cuda.reset_peak_memory_stats(k)
    fn()
    synchronize(device)
    return sum(torch.cuda.max_memory_allocated(k) - b for k, b in zip(gpus, base))


def describe(device: str) -> Dict[str, Any]:
    """What ran the benchmark, for its JSON and its tables' header."""
    info: Dict[str, Any] = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        info.update(cuda=torch.version.cuda, gpus=[torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())])
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def label(device: str) -> str:
    """One line naming the device, e.g. ``cuda: 1 x NVIDIA H100 80GB HBM3``."""
    if device != "cuda":
        return f"cpu ({platform.machine()})"
    names = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
    return f"cuda: {len(names)} x {names[0]}" + ("" if len(set(names)) == 1 else f" (+ {sorted(set(names))})")
