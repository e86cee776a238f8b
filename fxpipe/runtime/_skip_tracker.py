"""Skip trackers of ``@skippable`` modules (torchgpipe's): where stashed tensors wait.

Outside a pipeline a thread-local :class:`SkipTracker` keeps stashed tensors in a dict, so
skippable modules also run as plain modules. Inside the pipeline each micro-batch gets a
:class:`SkipTrackerThroughPortals`, which routes skips that cross partitions through
:class:`~fxpipe.runtime._portal.Portal` objects. Generated stage code has its own, simpler
tracker: :mod:`fxpipe.runtime._stage_portals`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Generator, Hashable, Optional

import torch
from torch import Tensor

from ..tree import flatten
from ._checkpoint import is_checkpointing
from ._dependency import fork, join
from ._microbatch import Batch
from ._phony import get_phony
from ._portal import Portal
from ._skip_layout import SkipKey, SkipLayout
from ._stream import AbstractStream

__all__ = ["SkipTracker", "SkipTrackerThroughPortals", "current_skip_tracker", "use_skip_tracker", "swap_skip_tracker",
           "merge_phony", "holds_tensor", "stash_portal", "copy_portal"]

Namespace = Hashable  # a fxpipe.skip.Namespace; the runtime only needs it as a key


class SkipTracker:
    """Stores skip tensors by (namespace, name) in a dict; used without a pipeline."""

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Optional[Namespace], name: str) -> Optional[Tensor]:
        try:
            return self.tensors.pop((ns, name))
        except KeyError:
            raise KeyError(f"skip '{name}' has not been stashed") from None

    def copy(
        self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
        ns: Optional[Namespace], name: str,
    ) -> None:
        raise TypeError("copy is only meaningful for skips carried by portals")

    def activate(self, batch: Batch) -> Optional["SkipTracker"]:
        """Makes this tracker current for the task computing ``batch``; returns the one
        to put back with :meth:`deactivate`."""
        return swap_skip_tracker(self)

    def deactivate(self, previous: Optional["SkipTracker"], output: Optional[Batch]) -> None:
        """Puts ``previous`` back once the task made ``output`` (``None``: it failed)."""
        swap_skip_tracker(previous)


class SkipTrackerThroughPortals(SkipTracker):
    """Carries skips that cross partitions through portals, for one micro-batch."""

    def __init__(self, skip_layout: SkipLayout) -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: Dict[SkipKey, Portal] = {}

    def save(self, batch: Batch, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> None:
        if not self.skip_layout.requires_copy(ns, name) or not holds_tensor(tensor):
            # Same partition, or a plain value (an int, a torch.Size): nothing to copy or
            # differentiate, so it waits in the dict. Structures holding tensors (a split
            # result, a ModelOutput) go through a portal like a tensor.
            super().save(batch, ns, name, tensor)
            return
        _join_into(batch, stash_portal(self.portals, (ns, name), tensor).blue(tensor))

    def load(self, batch: Batch, ns: Optional[Namespace], name: str) -> Optional[Tensor]:
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)
        if (ns, name) in self.tensors:
            # A plain value from an earlier partition: kept (not popped), because a
            # recomputation of this partition reads it again before the stash side reruns.
            return self.tensors[(ns, name)]
        portal = self.portals.get((ns, name))
        if portal is None:
            raise KeyError(f"skip '{name}' has not been stashed")
        anchor = batch.anchor()  # the module's input, as torchgpipe does
        return portal.orange(batch[anchor] if anchor is not None else None)

    def copy(
        self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
        ns: Optional[Namespace], name: str,
    ) -> None:
        """Moves a portal's tensor towards its pop partition, ordered by ``batch``."""
        if (ns, name) in self.tensors:
            return  # a plain value, not a tensor: nothing to move
        portal = self.portals.get((ns, name))
        if portal is None:
            raise RuntimeError(
                f"skip '{name}' has not been stashed: the partition that stashes it did not run "
                "stash for this micro-batch"
            )
        copy_portal(portal, batch, prev_stream, next_stream)


def stash_portal(portals: Dict[Any, Portal], key: Any, value: Any) -> Portal:
    """The portal carrying ``value`` under ``key``: a new one on the first stash, which the
    pop side uses once, or twice when it is recomputed; on a stash made again by the
    recomputation of the stash partition, the same portal with the new value, which
    ``PortalBlue`` needs once."""
    portal = portals.get(key)
    if portal is None:
        portal = portals[key] = Portal(value, 3 if is_checkpointing() else 2)
    else:
        portal.stash(value, 1)
    return portal


def copy_portal(portal: Portal, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Moves ``portal``'s value on the copy streams, after ``batch`` (the pop partition's
    input) in forward; its backward, moving the gradient back, before ``batch``'s."""
    anchor = batch.anchor()
    if anchor is None:
        _join_into(batch, portal.copy(prev_stream, next_stream, get_phony(torch.device("cpu"), requires_grad=False)))
        return
    batch[anchor], phony = fork(batch[anchor])
    phony = portal.copy(prev_stream, next_stream, phony)
    batch[anchor] = join(batch[anchor], phony)


def holds_tensor(value: object) -> bool:
    """Whether a stashed value needs a portal: a tensor, or a structure holding one."""
    if isinstance(value, Tensor):
        return True
    if value is None or isinstance(value, (int, float, str, torch.Size)):
        return False
    return any(isinstance(x, Tensor) for x in flatten(value)[0])


def merge_phony(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    """One tensor whose backward waits for both (either may be None)."""
    if a is None:
        return b
    if b is None:
        return a
    return join(a, b)


def _join_into(batch: Batch, phony: Tensor) -> None:
    """Makes backward through ``batch`` reach ``phony`` (a stash's gradient path).

    Without a floating-point tensor to join to, the phony goes on the batch's ``carry``,
    which the runtime passes from partition to partition with the batch; its backward runs
    only if something later depends on the carry. It goes there even when it needs no grad
    yet: in the activation-free pass of checkpointing nothing does, and the recomputation
    must find the same outputs.
    """
    anchor = batch.anchor()
    if anchor is None:
        batch.carry = merge_phony(batch.carry, phony)
    elif phony.requires_grad:
        batch[anchor] = join(batch[anchor], phony)


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


_local = _ThreadLocal()


def swap_skip_tracker(skip_tracker: Optional[SkipTracker]) -> Optional[SkipTracker]:
    """Makes ``skip_tracker`` current and returns the previous one (for hot paths)."""
    previous = _local.skip_tracker
    _local.skip_tracker = skip_tracker
    return previous


@contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Generator[None, None, None]:
    """Makes ``skip_tracker`` current for stash/pop in this thread, within the block
    (torchgpipe's API, for running skippable modules under a tracker by hand)."""
    previous = swap_skip_tracker(skip_tracker)
    try:
        yield
    finally:
        swap_skip_tracker(previous)


def current_skip_tracker() -> SkipTracker:
    """The tracker of the running pipeline task, or this thread's default one."""
    skip_tracker = _local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        _local.skip_tracker = skip_tracker
    return skip_tracker
