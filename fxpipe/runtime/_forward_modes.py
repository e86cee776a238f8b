"""What a stage's recomputation must share with its forward besides inputs: modes and weights.

A checkpointed stage runs again in backward. Eager backward differentiates the graph the
forward recorded, so between forward and backward the user may switch ``model.eval()`` (a
validation pass), call ``requires_grad_(False)`` (freezing), or -- wrongly -- update the
weights in place (``optimizer.step()`` before ``backward()``, which eager refuses with
"modified by an inplace operation"). A recomputation that ran with the new modes would save
other tensors (BatchNorm in eval mode saves tensors of other shapes: the autograd engine
crashed) or skip dropout; one with the new weights would give gradients of neither model.

:class:`ForwardModes` is taken once per stage per forward (not per task): every module's
``training`` flag, every parameter's ``requires_grad`` and version counter, read along a
:class:`StageLayout` (the stage's modules and parameters) listed once per pipeline. A recomputation
checks the versions (a changed parameter is refused with
:class:`~fxpipe.errors.CheckpointBackwardError` naming it, as eager refuses), and runs with the
recorded flags when they changed, putting the current ones back afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from operator import attrgetter
from typing import Any, Generator, List, Sequence, Tuple

from torch import Tensor, nn

from ..errors import CheckpointBackwardError

__all__ = ["StageLayout", "ForwardModes"]

# Plain attribute reads over a list: map(attrgetter) is about twice as fast as a comprehension.
_training = attrgetter("training")
_requires_grad = attrgetter("requires_grad")
_version = attrgetter("_version")


class StageLayout:
    """A stage's modules and parameters, listed once per pipeline.

    ``skip`` names parameters the stage itself updates in forward (its recomputation runs
    on their snapshot), whose versions change legitimately."""

    __slots__ = ("modules", "names", "params")

    def __init__(self, partition: Any, skip: Sequence[Tensor] = ()) -> None:
        self.modules: List[nn.Module] = []
        self.names: List[str] = []
        self.params: List[Tensor] = []
        if isinstance(partition, nn.Module):
            self.modules = list(partition.modules())
            skipped = {id(t) for t in skip}
            for name, p in partition.named_parameters():
                if id(p) not in skipped:
                    self.names.append(name)
                    self.params.append(p)


class ForwardModes:
    """The modes and parameter versions of one stage, as its forward ran with them."""

    __slots__ = ("modules", "training", "names", "params", "requires_grad", "versions")

    def __init__(self, layout: StageLayout) -> None:
        self.modules = layout.modules
        self.names = layout.names
        self.params = layout.params
        self.training = list(map(_training, self.modules))
        self.requires_grad = list(map(_requires_grad, self.params))
        self.versions = list(map(_version, self.params))

    def check(self, where: str) -> None:
        """Refuses to recompute when a parameter was modified in place since the forward."""
        if list(map(_version, self.params)) == self.versions:
            return
        for name, p, v in zip(self.names, self.params, self.versions):
            if p._version != v:
                raise CheckpointBackwardError(
                    f"parameter {name!r} of {where} was modified in place between its forward and backward "
                    "(an optimizer step, an EMA update, a weight tied and changed, or a later micro-batch's "
                    "forward writing it: nn.Embedding(max_norm=) set after the build), so the stage cannot be "
                    "recomputed for backward with the weights its forward used; eager PyTorch refuses this "
                    "too. Call backward() before changing the weights (optimizer.step() after "
                    "loss.backward()); for a forward that writes a weight, build the pipeline again after "
                    "setting it (the build checks such writes); or build with checkpoint='never'.")

    def changed(self) -> bool:
        """Whether a module's training flag or a parameter's requires_grad differs now."""
        return (list(map(_training, self.modules)) != self.training
                or list(map(_requires_grad, self.params)) != self.requires_grad)

    @contextmanager
    def restored(self) -> Generator[None, None, None]:
        """Runs the block with the forward's flags; puts the current ones back afterwards."""
        now: Tuple[List[bool], List[bool]] = ([m.training for m in self.modules],
                                              [p.requires_grad for p in self.params])
        for m, t in zip(self.modules, self.training):
            m.training = t
        for p, r in zip(self.params, self.requires_grad):
            p.requires_grad_(r)
        try:
            yield
        finally:
            for m, t in zip(self.modules, now[0]):
                m.training = t
            for p, r in zip(self.params, now[1]):
                p.requires_grad_(r)
