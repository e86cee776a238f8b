"""Portals of generated stage code: what ``stash(name, value)`` and ``pop(name)`` talk to.

Generated stages name each portal after its plan route (``relu__to3``), have no namespaces,
no same-stage skips and no ``Batch`` at hand, so they get their own small tracker rather
than special cases in torchgpipe's (:mod:`fxpipe.runtime._skip_tracker`):

* :class:`LocalPortals`, this thread's default, keeps stashed values in a dict, so stages
  also run as plain modules called one after another;
* :class:`StagePortals`, one per micro-batch inside a pipeline, carries each value through a
  :class:`~fxpipe.runtime._portal.Portal`, straight from the stash stage's device to the pop
  stage's, and orders the backward of both ends:

  - a stash's phony cannot be joined to an output tensor: the next stage may read that
    tensor only for its shape, or not at all, and the stash's gradient path would die with
    it. It rides on the output batch's ``carry`` instead, which goes from stage to stage;
  - a pop depends on its stage's input (the anchor tensor and the carry), so the popped
    value's gradient is left in the portal before the input's gradient, and the stash's
    gradient, are computed.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Union

from torch import Tensor

from ._microbatch import Batch
from ._portal import Portal
from ._skip_layout import SkipLayout
from ._skip_tracker import copy_portal, holds_tensor, merge_phony, stash_portal
from ._stream import AbstractStream

__all__ = ["LocalPortals", "StagePortals", "current_portals"]


class LocalPortals:
    """Stashed values in a dict, popped once: stages called by hand, outside a pipeline."""

    def __init__(self) -> None:
        self.values: Dict[str, Any] = {}

    def stash(self, name: str, value: Any) -> None:
        self.values[name] = value

    def pop(self, name: str) -> Any:
        return self.values.pop(name)  # KeyError: not stashed


class StagePortals(LocalPortals):
    """One micro-batch's portals inside a pipeline (the routes come from the plan)."""

    def __init__(self, layout: SkipLayout) -> None:
        super().__init__()
        self.layout = layout
        self.portals: Dict[str, Portal] = {}
        # Phonies of this task's stashes, put on its output's carry when it ends.
        self.pending: List[Tensor] = []
        # The input of the task running now: what its pops depend on.
        self.input: Optional[Batch] = None

    def stash(self, name: str, value: Any) -> None:
        if not holds_tensor(value):
            # A plain value (an int, a torch.Size): nothing to copy or differentiate.
            self.values[name] = value
            return
        self.pending.append(stash_portal(self.portals, name, value).blue(value))

    def pop(self, name: str) -> Any:
        if name in self.values:
            # Kept, not popped: a recomputation of this stage reads it again.
            return self.values[name]
        portal = self.portals[name]  # KeyError: not stashed
        source = self.input
        after = None
        if source is not None:
            anchor = source.anchor()
            after = merge_phony(source[anchor] if anchor is not None else None, source.carry)
        return portal.orange(after)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: None, name: str) -> None:
        """Moves portal ``name``'s value towards its pop stage, ordered by ``batch``."""
        if name in self.values:
            return  # a plain value: nothing to move
        portal = self.portals.get(name)
        if portal is None:
            raise RuntimeError(f"portal '{name}' has not been stashed: the stage that stashes it did not run "
                               "for this micro-batch")
        copy_portal(portal, batch, prev_stream, next_stream)

    def activate(self, batch: Batch) -> "Portals":
        """Makes these portals current for the task computing ``batch``."""
        self.input = batch
        return swap_portals(self)

    def deactivate(self, previous: "Portals", output: Optional[Batch]) -> None:
        """Puts ``previous`` back and hands this task's stashes to ``output``'s carry
        (``None``: the task failed)."""
        swap_portals(previous)
        self.input = None
        pending, self.pending = self.pending, []
        for phony in pending if output is not None else ():
            output.carry = merge_phony(output.carry, phony)


Portals = Union[LocalPortals, StagePortals]


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.portals: Portals = LocalPortals()


_local = _ThreadLocal()


def current_portals() -> Portals:
    """The portals of the running pipeline task, or this thread's default ones."""
    return _local.portals


def swap_portals(portals: Portals) -> Portals:
    """Makes ``portals`` current and returns the previous ones (a hot path: no context manager)."""
    previous = _local.portals
    _local.portals = portals
    return previous
