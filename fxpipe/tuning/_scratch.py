"""Scratch per node: the memory an operation allocates and frees inside itself, measured.

The recording (:mod:`fxpipe.tuning._nodes`) sees tensors: what each node returns and what
autograd saves. It cannot see what a kernel allocates for itself and frees before it returns:
im2col / reorder buffers of a convolution, the contiguous copy a convolution's backward makes
of a gradient that arrives as a slice of a concatenation's gradient, a softmax's temporaries.
On the U-Net that is ~18 MiB on the last stage's backward at 32 samples, 13-22% of the peak.

So, on a device with memory (CPU, CUDA; nothing on meta), the recording runs under
``torch.profiler`` with ``profile_memory=True``, which records every allocation and free of
the device allocators with its address and time. A :class:`ScratchMeter` window brackets
each node's forward (around the node's call) and each of its autograd functions in one
backward of the recorded graph (a pre-hook and a hook on every autograd node the fx node
created). A window's *scratch* is the most bytes alive at once among the allocations made
inside the window and freed inside it; allocations that outlive the window (outputs,
gradients) are not scratch: the recording counts them already. Windows are delimited by
allocations of two odd sizes (:data:`MARKS`), found again in the records and left out.

What is not seen: allocations of another process or of a thread that allocates outside a
window; with a profiler already running (only one can run), nothing is measured and every
scratch is 0 (:func:`available`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Hashable, Iterator, List, Optional

import torch

__all__ = ["MARKS", "ScratchMeter", "available"]

#: window start / end marks: allocations of these byte counts (odd primes: no float tensor has them)
MARKS = (999_983, 999_979)


def available(device_types: set) -> bool:
    """Whether scratch can be measured: real tensors (CPU or CUDA) and no profiler running."""
    if not device_types or not device_types <= {"cpu", "cuda"}:
        return False
    return not torch.autograd.profiler._is_profiler_enabled


class ScratchMeter:
    """Windows labelled by any hashable; :meth:`scratch` gives each label its largest scratch."""

    def __init__(self) -> None:
        self._labels: List[Hashable] = []
        self._prof: Optional[torch.profiler.profile] = None
        self.result: Dict[Hashable, int] = {}

    def begin(self, label: Hashable) -> None:
        self._labels.append(label)
        mark = torch.empty(MARKS[0], dtype=torch.uint8)
        del mark

    def end(self) -> None:
        mark = torch.empty(MARKS[1], dtype=torch.uint8)
        del mark

    @contextlib.contextmanager
    def recording(self) -> Iterator["ScratchMeter"]:
        """Profiles the allocations of everything inside; :attr:`result` is filled at exit."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        self.result = self._windows(_allocations(prof))

    def _windows(self, records: List[tuple[int, int, int]]) -> Dict[Hashable, int]:
        """records: (time, address, +bytes allocated / -bytes freed) in time order."""
        result: Dict[Hashable, int] = {}
        window: Optional[List[tuple[int, int]]] = None
        marks = {MARKS[0]: 0, MARKS[1]: 0}
        mark_ptrs = set()
        k = 0
        for _, ptr, nbytes in records:
            if nbytes in marks:  # a window mark being allocated
                mark_ptrs.add(ptr)
                if nbytes == MARKS[0]:
                    window = []
                elif window is not None:
                    label = self._labels[k] if k < len(self._labels) else None
                    k += 1
                    result[label] = max(result.get(label, 0), _scratch(window))
                    window = None
                continue
            if nbytes < 0 and ptr in mark_ptrs and -nbytes in marks:
                mark_ptrs.discard(ptr)
                continue
            if window is not None:
                window.append((ptr, nbytes))
        result.pop(None, None)
        return result


def _scratch(events: List[tuple[int, int]]) -> int:
    """The most bytes alive at once among allocations made and freed within ``events``."""
    freed_inside = set()
    live: Dict[int, int] = {}
    for i, (ptr, nbytes) in enumerate(events):
        if nbytes > 0:
            live[ptr] = i
        elif ptr in live:
            freed_inside.add(live.pop(ptr))
    current = peak = 0
    sizes: Dict[int, int] = {}
    for i, (ptr, nbytes) in enumerate(events):
        if nbytes > 0 and i in freed_inside:
            sizes[ptr] = nbytes
            current += nbytes
            peak = max(peak, current)
        elif nbytes < 0 and ptr in sizes:
            current -= sizes.pop(ptr)
    return peak


def _allocations(prof: "torch.profiler.profile") -> List[tuple[int, int, int]]:
    """Every allocator record of the profile: (time, address, signed bytes), in time order
    (a stable sort: records of one moment keep the order the tree lists them in)."""
    found: List[tuple[int, int, int]] = []
    allocation = torch._C._profiler._EventType.Allocation
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        if node.tag == allocation:
            f = node.extra_fields
            if f.alloc_size:
                found.append((node.start_time_ns, int(f.ptr), int(f.alloc_size)))
        stack.extend(reversed(node.children))
    found.sort(key=lambda r: r[0])
    return found
