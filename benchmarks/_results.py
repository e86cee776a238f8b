"""How a benchmark describes its machine and writes its JSON result: one shape for every
``benchmarks/results/*.json``, so runs from different machines and days compare field by field."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict

import torch


def header(benchmark: str, device: str, **machine: Any) -> Dict[str, Any]:
    """The fields every result starts with: the benchmark, the date and the machine it ran on
    (``machine`` adds entries, e.g. the thread count that benchmark pins)."""
    return {
        "benchmark": benchmark,
        "date": _dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(), "device": device, **machine},
    }


def write_json(path: str, result: Dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)
