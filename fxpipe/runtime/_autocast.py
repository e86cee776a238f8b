"""The caller's autocast state, captured once and entered again elsewhere.

Autocast is thread-local and scoped to a ``with`` block. Two places run a stage outside the
block that started it: a worker thread (CUDA pipelines), and the recomputation of a
checkpointed stage, which happens during backward -- usually outside the user's
``torch.autocast`` region. Both must compute in the dtype of the original forward, as
``torch.utils.checkpoint`` does, or the recomputed activations differ from the first pass
(or fail: "mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import ContextManager, Tuple

import torch

__all__ = ["AutocastState", "autocast_state", "entered", "is_default"]

# (device type, enabled, dtype) per device type, and whether the cast cache is on.
AutocastState = Tuple[Tuple[Tuple[str, bool, torch.dtype], ...], bool]

_DEVICE_TYPES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def autocast_state() -> AutocastState:
    """This thread's autocast settings, now (read for every pipeline task: no generator)."""
    per_device = tuple([(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES])
    return per_device, torch.is_autocast_cache_enabled()


def is_default(state: AutocastState) -> bool:
    """Whether ``state`` has autocast off everywhere (nothing to enter)."""
    return not any(enabled for _, enabled, _ in state[0])


def entered(state: AutocastState) -> ContextManager[None]:
    """A context that sets exactly ``state`` (also switching autocast *off* where it was off)."""
    if state == autocast_state():
        return nullcontext()  # already in force: entering would only cost time
    stack = ExitStack()
    per_device, cache = state
    for device_type, enabled, dtype in per_device:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack
