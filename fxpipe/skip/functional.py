"""Stash and pop as plain functions, for generated stage code.

``fxpipe.pipeline`` rewrites every value that skips over a stage into ``stash(name, value)``
in the producing stage and ``value = pop(name)`` in the consuming one. These are ordinary
``call_function`` nodes in the stage's fx graph, backed by the same trackers and portals as
``@skippable``: inside the pipeline the value travels through a portal, outside it (calling
the stages one after another by hand) through the thread's default tracker.
"""

from __future__ import annotations

from typing import Optional

import torch.fx
from torch import Tensor

from .tracker import current_skip_tracker

__all__ = ["stash", "pop"]


def stash(name: str, value: Optional[Tensor]) -> None:
    """Hands ``value`` to the skip named ``name``; a later stage pops it."""
    current_skip_tracker().save(None, None, name, value)


def pop(name: str) -> Optional[Tensor]:
    """Takes the value stashed under ``name`` by an earlier stage."""
    try:
        return current_skip_tracker().load(None, None, name)
    except KeyError:
        raise RuntimeError(
            f"skip '{name}' has not been stashed: the stage that produces it must run first, "
            "for the same micro-batch"
        ) from None


# Dead-code elimination must never drop a stash: it has no users but matters.
torch.fx.node.has_side_effect(stash)
torch.fx.node.has_side_effect(pop)
