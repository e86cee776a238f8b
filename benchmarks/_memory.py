"""Peak CPU memory of one call, from the profiler's raw allocator records (shared by benchmarks).

``torch.profiler.profile(activities=[CPU], profile_memory=True)`` records one ``[memory]``
event per allocation (+bytes) and per free (-bytes) of the CPU allocator, on every thread.
Sorting those raw records by timestamp and taking the running sum gives the bytes allocated
*during the call* at each moment; the peak is its maximum. ``prof.events()``' operator events
are not used: a ``FunctionEvent``'s ``cpu_memory_usage`` sums every record inside its time
interval (nested operators and other threads included), so summing them counts an allocation
several times. Sanity check: ``end_bytes`` (the running sum at the end) is ~0 when everything
the call allocated was freed by its end (e.g. a full forward + backward step).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

HOW = "torch.profiler raw [memory] records (kineto_results), running sum of +alloc/-free by timestamp, max"


def cpu_peak(fn: Callable[[], None]) -> Dict[str, Any]:
    """Runs ``fn()`` under the profiler; returns peak_bytes, end_bytes, alloc_events, threads, how."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = sorted(
        (e.start_ns(), e.nbytes(), e.start_thread_id())
        for e in records
        if e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes()
    )
    running = peak = 0
    for _, b, _ in events:
        running += b
        peak = max(peak, running)
    threads = {t for _, _, t in events}
    return {"peak_bytes": peak, "end_bytes": running, "alloc_events": len(events), "threads": len(threads),
            "how": HOW}
