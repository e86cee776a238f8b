"""Phony tensors: empty tensors that only carry autograd dependencies."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["get_phony"]

_phonies: Dict[Tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """A cached size-0 tensor for ``device``.

    Phonies cost no memory and let the pipeline add edges to the autograd graph (Fork/Join,
    portals, recomputation) without touching real data. Callers must ``.detach()`` a phony
    before returning it from an autograd function, so the cached one is never mutated.
    """
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with torch.no_grad(), torch.inference_mode(False):
            phony = torch.empty(0, device=device, requires_grad=requires_grad)
        _phonies[key] = phony
    return phony
