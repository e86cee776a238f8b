"""Peak memory of one call, whole or per phase (shared by benchmarks).

CPU: ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` records one
``[memory]`` event per allocation (+bytes) and per free (-bytes) of the CPU allocator, on
every thread. Sorting those raw records by timestamp and taking the running sum gives the
bytes allocated *during the call* at each moment; the peak is its maximum. ``prof.events()``'
operator events are not used: a ``FunctionEvent``'s ``cpu_memory_usage`` sums every record
inside its time interval (nested operators and other threads included), so summing them
counts an allocation several times. Sanity check: ``end_bytes`` (the running sum at the end)
is ~0 when everything the call allocated was freed by its end (e.g. a full forward +
backward step).

CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the call, on one device.

Phases: code running inside the call (an autograd hook, say) calls :meth:`Meter.mark` to
end one phase and start the next; the meter reports each phase's own peak. On CPU a mark is
an allocation of a size no tensor here has (``MARK_BASE + k`` bytes), found again in the
records and left out of the sums; on CUDA it reads and resets the device's peak statistic.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

HOW = "torch.profiler raw [memory] records (kineto_results), running sum of +alloc/-free by timestamp, max"
HOW_CUDA = "torch.cuda.max_memory_allocated - memory_allocated before the call, one device"

#: marks are allocations of MARK_BASE + k bytes (k < MARK_SPAN): odd sizes no benchmark tensor has
MARK_BASE = 977_771
MARK_SPAN = 1000


class Meter:
    """Measures one call's peak on ``device``; :meth:`mark` splits it into phases."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = torch.device(device)
        self._cuda_base = 0
        self._cuda_phases: List[Dict[str, Any]] = []
        self._label: Optional[int] = None

    def mark(self, k: int) -> None:
        """Ends the current phase; the next one is labelled ``k`` (0 <= k < MARK_SPAN)."""
        if not 0 <= k < MARK_SPAN:
            raise ValueError(f"mark {k} out of range [0, {MARK_SPAN})")
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
            self._cuda_phases.append({"label": self._label, "peak_bytes": peak})
            self._label = k
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        marker = torch.empty(MARK_BASE + k, dtype=torch.uint8)
        del marker

    def run(self, fn: Callable[[], None]) -> Dict[str, Any]:
        """Runs ``fn()``; returns peak_bytes, end_bytes and ``phases``: one dict per phase
        (``label``: the mark that began it, None for the first; ``peak_bytes``: the most
        allocated during it, relative to before the call; on CPU ``start_bytes`` and ``min_bytes``: allocated
        when it began, and the least during it), plus profiler details on CPU."""
        if self.device.type == "cuda":
            return self._run_cuda(fn)
        return self._run_cpu(fn)

    def _run_cuda(self, fn: Callable[[], None]) -> Dict[str, Any]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._cuda_base = torch.cuda.memory_allocated(self.device)
        self._cuda_phases, self._label = [], None
        fn()
        torch.cuda.synchronize(self.device)
        last = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        phases = self._cuda_phases + [{"label": self._label, "peak_bytes": last}]
        end = torch.cuda.memory_allocated(self.device) - self._cuda_base
        return {"peak_bytes": max(p["peak_bytes"] for p in phases), "end_bytes": end, "phases": phases,
                "how": HOW_CUDA}

    def _run_cpu(self, fn: Callable[[], None]) -> Dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        records = [
            (e.start_ns(), e.nbytes(), e.start_thread_id())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes()
        ]
        records.sort(key=lambda r: r[0])  # stable: records of one moment keep their order
        phases = [{"label": None, "peak_bytes": 0, "start_bytes": 0, "min_bytes": 0}]
        running = count = 0
        threads = set()
        for _, nbytes, thread in records:
            k = abs(nbytes) - MARK_BASE
            if 0 <= k < MARK_SPAN:  # a mark, not memory
                if nbytes > 0:
                    phases.append({"label": k, "peak_bytes": running, "start_bytes": running,
                                   "min_bytes": running})
                continue
            running += nbytes
            count += 1
            threads.add(thread)
            phases[-1]["peak_bytes"] = max(phases[-1]["peak_bytes"], running)
            phases[-1]["min_bytes"] = min(phases[-1]["min_bytes"], running)
        return {"peak_bytes": max(p["peak_bytes"] for p in phases), "end_bytes": running, "phases": phases,
                "alloc_events": count, "threads": len(threads), "how": HOW}


def cpu_peak(fn: Callable[[], None]) -> Dict[str, Any]:
    """Runs ``fn()`` under the profiler; returns peak_bytes, end_bytes, alloc_events, threads, how."""
    result = Meter().run(fn)
    result.pop("phases")
    return result


def peak(fn: Callable[[], None], device: torch.device) -> Dict[str, Any]:
    """``fn()``'s peak on ``device`` (CPU: profiler records; CUDA: the device's statistics)."""
    return Meter(device).run(fn)
