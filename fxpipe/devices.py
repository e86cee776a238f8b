"""Which devices a pipeline's stages run on when the caller names none.

One rule for every entry point (``fxpipe.pipeline``, ``fxpipe.GPipe``, ``fxpipe.balance``,
the command line and the demo), so they cannot drift apart: the CUDA devices in turn, else
the CPU for every stage.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["default_devices"]


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
