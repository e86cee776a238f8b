"""The buffers a stage updates in forward: what its checkpoint recomputation must snapshot.

A checkpointed stage runs twice; a buffer its forward updates in place (BatchNorm running
statistics, a step counter) must be updated once, and the recomputation must see it as the
first pass did (:mod:`fxpipe.runtime._checkpoint` swaps a snapshot in). Two sources say which:

* the run on the sample (:mod:`fxpipe.capture._mutation`) tags the nodes that changed a buffer;
* that run only sees the mode the model was built in: a model built in ``eval()`` and then
  trained updates BatchNorm statistics the sample never showed. So every running buffer of a
  torch normalization layer the stage calls (``track_running_stats``: BatchNorm*,
  InstanceNorm*, SyncBatchNorm, and fxpipe's deferred BatchNorm) is listed too, whatever the
  build's mode. Snapshotting a buffer that turns out unchanged costs a copy, not a result.

Each slot names the module the stage's *code* reads the buffer from. A stage whose code reads
``self.bn.running_mean`` (a torch.export graph: ``get_attr``) holds its own shell modules along
that path, made by ``GraphModule``, with the model's tensors in them; swapping the model's
module's entry would leave the shell's, and the recomputation then updated the live statistics
a second time (HF ResNet, 3 updates per step for 2 micro-batches). A module the stage calls
(``call_module``) is the model's own object, where both are the same.
"""

from __future__ import annotations

from typing import List

from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase

from ..capture._mutation import MUTATES_STATE
from ..runtime._checkpoint import StateSlot as Slot

__all__ = ["mutable_state"]

_RUNNING_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def mutable_state(model: nn.Module, stage: fx.GraphModule) -> List[Slot]:
    """``(module, '_buffers' | '_parameters', key)`` of every tensor ``stage`` may update in
    forward: those the sample run saw updated, and the running statistics of every
    normalization layer the stage calls (see the module docstring)."""
    slots: List[Slot] = []
    for node in stage.graph.nodes:
        for name in node.meta.get(MUTATES_STATE, ()):
            owner_name, _, key = name.rpartition(".")
            owner = _read_from(stage, model, owner_name, key)
            _add(slots, (owner, "_buffers" if key in owner._buffers else "_parameters", key))
    for node in stage.graph.nodes:
        if node.op != "call_module":
            continue
        for sub in stage.get_submodule(node.target).modules():
            if isinstance(sub, _NormBase) and sub.track_running_stats:
                for key in _RUNNING_BUFFERS:
                    if sub._buffers.get(key) is not None:
                        _add(slots, (sub, "_buffers", key))
    return slots


def _read_from(stage: fx.GraphModule, model: nn.Module, owner_name: str, key: str) -> nn.Module:
    """The module whose ``key`` the stage's code reads: the stage's own module at that path
    when it holds the tensor there (a shell of a ``get_attr`` path, or the model's module it
    calls), else the model's."""
    try:
        held = stage.get_submodule(owner_name)
    except AttributeError:
        held = None
    if held is not None and (key in held._buffers or key in held._parameters):
        return held
    return model.get_submodule(owner_name)


def _add(slots: List[Slot], slot: Slot) -> None:
    if not any(s[0] is slot[0] and s[1:] == slot[1:] for s in slots):
        slots.append(slot)
