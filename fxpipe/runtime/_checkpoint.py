"""Checkpointing through saved-tensor hooks, with recomputation on time (torchgpipe §3.2.1).

A checkpointed task runs its partition once in forward, recording the autograd graph as
usual, but under :class:`torch.autograd.graph.saved_tensors_hooks`: every tensor an
operation saves for backward is replaced by its index, and the tensor itself is dropped.
When backward first needs one of them, the partition runs again from its inputs -- the
recomputation -- and the hooks hand each node its recomputed tensor. This is the mechanism
of ``torch.utils.checkpoint(use_reentrant=False)``, kept lean for the one case here:

* there is no autograd Function around the partition and no backward of its own inside the
  outer one, so ``torch.autograd.grad``, ``backward(inputs=...)``, ``retain_graph=True``
  and double backward (``create_graph=True``) are exact: they differentiate the forward's
  own graph, whose saved tensors come back attached to it;
* per task it costs the hooks (one Python call per saved tensor) and the recomputation,
  against the previous Checkpoint/Recompute Functions' Python forward and backward and a
  re-entrant engine call.

**When the recomputation runs.** By default where the first saved tensor is unpacked, i.e.
once the stage's output gradient is there: on CPU nothing asynchronous could overlap it, and
stages sharing one GPU receive no copy. On an accelerator partition whose gradient comes
from another device the paper wants it scheduled *before* the incoming gradient copy is
waited on, so that recomputation and copy overlap (the runner decides, per partition): :meth:`Checkpointing.recompute` (``ahead``)
then forks a :class:`Recompute` node off the task's output and joins it back; its backward,
which autograd reaches before the ``Wait`` for the gradient copy, recomputes ahead, and the
hooks only look the tensors up.

**What the recomputation reproduces.** The RNG states (dropout draws the same numbers;
saved only for partitions that may draw, see :mod:`~fxpipe.runtime._randomness`; a
``torch.Generator`` the stage uses itself is saved and put back alike), the
autocast state (recomputation runs in backward, outside the user's ``torch.autocast``), and
the buffers and parameters the partition updates in forward (see ``_state_swapped``;
``nn.Embedding(max_norm=...)`` renormalises its weight): the recomputation sees them as the
first pass did, and its own updates are dropped; and the modules' training
flags and parameters' ``requires_grad`` as the forward ran with them (``model.eval()``
between forward and backward), while a parameter modified in place since the forward is
refused (see :mod:`~fxpipe.runtime._forward_modes`). A recomputation that saves other tensors
(count or shapes) than the forward is refused rather than handed to autograd. ``is_checkpointing()`` /
``is_recomputing()`` tell a layer which pass runs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import CheckpointBackwardError
from ..tree import flatten_values, unflatten_values
from ._autocast import AutocastState, autocast_state
from ._autocast import entered as entered_autocast
from ._dependency import fork, join
from ._forward_modes import ForwardModes
from ._microbatch import Batch
from ._randomness import RNGStates, restored_generators, restored_rng_states, save_rng_states

__all__ = ["is_checkpointing", "is_recomputing", "checkpointing_task", "recomputing_task", "Checkpointing",
           "Recompute"]


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.checkpointing: Optional[Checkpointing] = None
        self.recomputing: Optional[Checkpointing] = None


_local = _ThreadLocal()


def is_checkpointing() -> bool:
    """True while the current forward runs under checkpointing (the first, activation-free pass)."""
    return _local.is_checkpointing


def is_recomputing() -> bool:
    """True while the current forward is a recomputation; use it to skip repeated side effects."""
    return _local.recomputing is not None


def checkpointing_task() -> Optional["Checkpointing"]:
    """The checkpointed task whose first pass this thread runs now, if any (a portal popped
    there tells it: see :meth:`Checkpointing.popped`)."""
    return _local.checkpointing


def recomputing_task() -> Optional["Checkpointing"]:
    """The checkpointed task this thread is recomputing now, if any (portals keep their
    values in it: see :meth:`Checkpointing.keep`)."""
    return _local.recomputing


Function = Callable[[Batch], Batch]

#: One piece of mutable module state: (module, "_buffers" or "_parameters", key).
StateSlot = Tuple[torch.nn.Module, str, str]


@contextmanager
def _state_swapped(slots: Sequence[StateSlot], snapshot: Sequence[Tensor]) -> Generator[None, None, None]:
    """Runs the block with each slot holding its snapshot instead of the live tensor.

    The recomputation of a stage that updates a buffer in forward (running statistics, a
    counter) must see the buffer as the first pass saw it, not as later micro-batches left
    it, and must not apply its update a second time. Swapping the *object* (not copying
    data into the live buffer) keeps the live buffer's version counter untouched, so
    nothing saved for backward is invalidated, and the recomputation's own update lands on
    the snapshot, which is dropped.
    """
    live = []
    for (module, where, key), saved in zip(slots, snapshot):
        table = module.__dict__[where]
        live.append(table[key])
        table[key] = saved
    try:
        yield
    finally:
        for (module, where, key), tensor in zip(slots, live):
            module.__dict__[where][key] = tensor


def _snapshot(live: Tensor) -> Tensor:
    """A copy of a buffer or parameter the stage updates in forward, for its recomputation. A
    parameter's copy requires grad as the parameter does, so that the recomputation records
    (and saves for backward) what the forward did with it: ``nn.Embedding(max_norm=...)``
    renormalises its weight in place under no_grad, then looks rows up in it."""
    return live.detach().clone().requires_grad_(live.requires_grad)


def _detached(batch: Batch) -> Batch:
    """``batch`` with every tensor detached, keeping whether it requires grad: the inputs
    of a recomputation, which must save the same tensors the first pass saved."""
    values = batch.values
    if all(type(v) is not list and type(v) is not tuple and type(v) is not dict for v in values):
        new = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v for v in values]
    else:
        leaves, spec = flatten_values(values)
        new = unflatten_values([v.detach().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v
                                for v in leaves], spec)
    out = Batch(new[0] if batch.atomic else tuple(new), atomic=batch.atomic)
    carry = batch.carry
    if carry is not None:
        out.carry = carry.detach().requires_grad_(carry.requires_grad)
    return out


def _versions(batch: Batch) -> List[int]:
    """The version counters of ``batch``'s tensors (they change with every in-place op)."""
    versions = []
    for v in batch.values:
        if isinstance(v, Tensor):
            versions.append(v._version)
        elif not isinstance(v, _SCALARS):
            return [t._version for t in batch.tensors()]  # a structure: its tensor leaves
    return versions


_SCALARS = (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device)


class Checkpointing:
    """Checkpoint and recompute one (micro-batch, partition) task.

    ``random``: whether the partition may draw random numbers (then the RNG states are
    saved). ``state`` lists the buffers the partition updates in forward; they are
    snapshotted before the first pass and swapped in for the recomputation. ``ahead``:
    recompute from a :class:`Recompute` node before the stage's backward (accelerators)
    rather than at the first unpacked tensor. ``where`` names the task in errors. ``modes``:
    the stage's flags and parameter versions at this forward (shared by its tasks), which the
    recomputation runs with and checks. ``generators``: the stage's own ``torch.Generator``
    objects, whose states are saved and put back like the RNG states.
    """

    __slots__ = ("function", "inputs", "device", "random", "state", "ahead", "where", "modes", "generators",
                 "generator_states", "snapshot",
                 "autocast", "rng_states", "versions", "count", "shapes", "recomputed", "left", "kept", "portals",
                 "__weakref__")

    def __init__(self, function: Function, batch: Batch, device: torch.device, *, random: bool = True,
                 state: Sequence[StateSlot] = (), ahead: bool = False, where: str = "a checkpointed stage",
                 modes: Optional[ForwardModes] = None, generators: Sequence[torch.Generator] = ()) -> None:
        self.function = function
        self.inputs = batch
        self.device = device
        self.random = random
        self.state = state
        self.ahead = ahead
        self.where = where
        self.modes = modes
        self.generators = generators
        self.generator_states: List[Tensor] = []
        self.snapshot: List[Tensor] = []
        self.autocast: AutocastState = autocast_state()
        self.rng_states: Optional[RNGStates] = None
        self.versions: List[int] = []
        self.count = 0  # tensors saved by the first pass
        self.shapes: List[torch.Size] = []  # their shapes: a recomputation must save the same
        self.recomputed: Optional[List[Optional[Tensor]]] = None
        self.left = 0  # recomputed tensors not handed out yet
        self.kept: Optional[Dict[Any, Any]] = None
        self.portals: Optional[List[Any]] = None  # portals popped by the first pass

    def checkpoint(self) -> Batch:
        """Runs the partition, recording its graph but keeping none of its saved tensors."""
        if self.random:
            self.rng_states = save_rng_states(self.device)
        if self.generators:
            self.generator_states = [g.get_state() for g in self.generators]
        if self.state:
            self.snapshot = [_snapshot(module.__dict__[where][key]) for module, where, key in self.state]
        batch = self.inputs
        versions = _versions(batch)
        orig, orig_task = _local.is_checkpointing, _local.checkpointing
        _local.is_checkpointing = True
        _local.checkpointing = self
        _push_hooks(self._pack, self._unpack)
        try:
            output = self.function(batch)
        finally:
            _pop_hooks()
            _local.is_checkpointing = orig
            _local.checkpointing = orig_task
        portals, self.portals = self.portals, None
        if portals is not None and not self.count:
            # Nothing saved: no recomputation will pop these portals again, so the use each
            # kept for it is spent now, and the skip tensor freed before backward reaches it.
            for portal in portals:
                portal.skip_recomputation()
        self.versions = _versions(batch)
        if self.versions != versions:
            raise CheckpointBackwardError(
                f"{self.where} modified its input in place, which a checkpointed stage cannot do: its "
                "recomputation in backward would start from the modified value. Make the operation out of "
                "place, or build the pipeline with checkpoint='never'.")
        return output

    def _pack(self, x: Tensor) -> int:
        n = self.count
        self.count = n + 1
        self.shapes.append(x.shape)
        return n

    def _unpack(self, n: int) -> Tensor:
        recomputed = self.recomputed
        if recomputed is None or recomputed[n] is None:
            recomputed = self._recompute()
        x = recomputed[n]
        recomputed[n] = None
        self.left -= 1
        if self.left == 0:
            self.recomputed = None
        return x  # type: ignore[return-value]

    def recompute_ahead(self) -> None:
        """Recomputes now, unless a recomputation waits to be used (``Recompute``'s backward)."""
        if self.count and self.recomputed is None:
            self._recompute()

    def _recompute(self) -> List[Optional[Tensor]]:
        """Runs the partition again from its inputs and keeps what it saves for backward."""
        if _versions(self.inputs) != self.versions:
            raise CheckpointBackwardError(
                f"the inputs of {self.where} were modified in place after its forward, so it cannot be "
                "recomputed for backward. Modify a copy instead, or build the pipeline with checkpoint='never'.")
        modes = self.modes
        if modes is not None:
            modes.check(self.where)
        saved: List[Optional[Tensor]] = []

        def pack(x: Tensor) -> Tensor:
            x = x.detach() if x.requires_grad else x
            saved.append(x)
            return x

        batch = _detached(self.inputs)
        orig = _local.recomputing
        _local.recomputing = self
        # Plain calls, and contexts only where there is something to set: this runs once per
        # checkpointed task (each context manager costs 1-3 us).
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        _push_hooks(pack, _identity)
        try:
            if modes is None or not modes.changed():
                self._rerun_autocast(batch)
            else:  # model.eval() / requires_grad_(False) since the forward: rerun as it ran
                with modes.restored():
                    self._rerun_autocast(batch)
        finally:
            _pop_hooks()
            torch._C._set_grad_enabled(grad_mode)
            _local.recomputing = orig
        if len(saved) != self.count:
            raise CheckpointBackwardError(
                f"the recomputation of {self.where} saved {len(saved)} tensors for backward where its forward "
                f"saved {self.count}: the stage did not run the same operations twice (its control flow "
                "depends on something that changed between forward and backward). Build the pipeline with "
                "checkpoint='never', or make the stage's forward depend only on its inputs and parameters.")
        if [x.shape for x in saved] != self.shapes:
            raise CheckpointBackwardError(
                f"the recomputation of {self.where} saved tensors of other shapes for backward than its forward "
                "did: the stage did not run the same operations twice (its control flow depends on something "
                "that changed between forward and backward). Build the pipeline with checkpoint='never', or "
                "make the stage's forward depend only on its inputs, parameters and training mode.")
        self.recomputed = saved
        self.left = len(saved)
        return saved

    def _rerun_autocast(self, batch: Batch) -> None:
        """:meth:`_rerun` under the forward's autocast state."""
        if self.autocast == autocast_state():
            self._rerun(batch)
        else:
            with entered_autocast(self.autocast):
                self._rerun(batch)

    def _rerun(self, batch: Batch) -> None:
        """The partition on ``batch`` with the first pass's buffers and RNG states."""
        if self.generator_states:  # the stage's own generators, as the first pass found them
            with restored_generators(self.generators, self.generator_states):
                self._rerun_buffers(batch)
        else:
            self._rerun_buffers(batch)

    def _rerun_buffers(self, batch: Batch) -> None:
        if not self.state and self.rng_states is None:
            self.function(batch)
            return
        # A fresh copy of the snapshot each time: a second backward (retain_graph=True)
        # recomputes again and must see the buffers as the first pass saw them.
        snapshot = [_snapshot(s) for s in self.snapshot]
        with _state_swapped(self.state, snapshot):
            if self.rng_states is None:
                self.function(batch)
            else:
                with restored_rng_states(self.device, self.rng_states):
                    self.function(batch)

    def popped(self, portal: Any) -> None:
        """The first pass popped ``portal``, which keeps its value for this task's
        recomputation (see :mod:`~fxpipe.runtime._portal`)."""
        if self.portals is None:
            self.portals = []
        self.portals.append(portal)

    def keep(self, key: Any, value: Any) -> Any:
        """``value`` as first kept under ``key`` by this task's recomputations.

        A portal popped by a checkpointed stage hands its value to the first recomputation
        and drops it; the value is kept here, as long as the stage's graph holds this task,
        so a second backward through the same graph (``retain_graph=True``, or
        ``create_graph=True``, which retains it) recomputes from the same value."""
        if self.kept is None:
            self.kept = {}
        return self.kept.setdefault(key, value)

    def recompute(self, batch: Batch) -> None:
        """Attaches the recomputation to ``batch``, the checkpointed output, in place, when it
        is to run ahead of the stage's backward (see the module docstring)."""
        if not self.ahead or not self.count:
            return
        anchor = batch.anchor()
        target = batch[anchor] if anchor is not None else batch.carry
        if target is None or not target.requires_grad:
            return
        target, phony = fork(target)
        phony = Recompute.apply(phony, self)
        target = join(target, phony)
        if anchor is not None:
            batch[anchor] = target
        else:
            batch.carry = target


def _identity(x: Tensor) -> Tensor:
    return x


# What ``torch.autograd.graph.saved_tensors_hooks`` enters and exits, called directly: the
# context manager object costs ~1.7 us more per use, twice per checkpointed task.
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


class Recompute(torch.autograd.Function):
    """A phony whose backward recomputes a checkpointed task ahead of its backward."""

    @staticmethod
    def forward(ctx, phony: Tensor, chk: Checkpointing) -> Tensor:  # type: ignore[override]
        ctx.chk = chk
        ctx.set_materialize_grads(False)
        return phony.detach()

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]) -> Tuple[None, None]:  # type: ignore[override]
        ctx.chk.recompute_ahead()
        return None, None
