"""Where a pipeline's stages run when the caller does not say: devices and CPU threads.

One rule for every entry point (``fxpipe.pipeline``, ``fxpipe.GPipe``, ``fxpipe.balance``,
the command line and the demo), so they cannot drift apart: the CUDA devices in turn, else
the CPU for every stage; one intra-op thread when every stage shares the CPU.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import torch

__all__ = ["Device", "default_devices", "set_threads"]

#: what a ``devices=`` argument may name a device by
Device = Union[torch.device, int, str]


def default_devices(n: int, *, one_stage_per_gpu: bool = False) -> List[torch.device]:
    """The devices of ``n`` stages: the CUDA devices in turn, else the CPU ``n`` times.

    With fewer CUDA devices than stages, stages share them round-robin, unless
    ``one_stage_per_gpu`` (torchgpipe's rule, kept by ``fxpipe.GPipe``): then the CUDA
    devices are returned once each, and the caller reports too few devices. Without CUDA
    every stage runs on the CPU (fxpipe's one change to torchgpipe, which fails instead).
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if one_stage_per_gpu:
            return [torch.device("cuda", i) for i in range(count)]
        return [torch.device("cuda", i % count) for i in range(n)]
    return [torch.device("cpu")] * n


def set_threads(threads: Optional[int], devices: Sequence[Any]) -> int:
    """Intra-op threads for a run: ``threads``, or 1 when all stages share the CPU.

    Stage workers run concurrently; with every stage on the CPU each would start its own
    parallel regions on the same cores, and the oversubscribed OpenMP pools can slow a
    step down by orders of magnitude on a loaded machine.
    """
    if threads is None and all(str(d).startswith("cpu") for d in devices):
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
