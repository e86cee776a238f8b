"""Each module's ``training`` flag, where the graph baked it in: a switch refused (``fxpipe.distributed``).

torch.export bakes every traced module's mode into aten ops (``dropout``, ``batch_norm`` with
its ``training`` argument), and a torch.fx forward that reads ``self.training`` keeps the value
as a constant (:func:`fxpipe.capture._prepare.mode_sensitivity`). Switching the root mode is
handled where the pipeline is called (:class:`~fxpipe.errors.ModeError`); switching a
*submodule* (``model.bn.eval()`` to freeze BatchNorm for fine-tuning, dropout turned off or
back on) would be silently ignored by such a graph. :class:`ModeFlags` records every module's
flag at the build and refuses a call after any of them changed, naming the modules, with
:class:`~fxpipe.errors.ModelChangedError`. A graph that follows the flags (torch.fx with the
mode-dependent layers called as modules) records nothing and checks nothing. ``fxpipe.pipeline``
follows such switches instead, with a capture per set of flags (:mod:`fxpipe._mode_variants`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, List, Sequence, Tuple

from torch import nn

from ..errors import ModelChangedError

__all__ = ["ModeFlags", "Flags", "flags_of", "modes_kept", "mode_changes", "listed"]

#: every module's ``training`` flag, in ``model.modules()`` order
Flags = Tuple[bool, ...]


def flags_of(modules: Iterable[nn.Module]) -> Flags:
    """The flags of ``modules`` (``model.modules()``, or the list of them taken at a build)."""
    return tuple(m.training for m in modules)


@contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Runs the block, then puts every module's own ``training`` flag back (``model.train(x)``
    would set them all to one)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def mode_changes(named: Sequence[Tuple[str, nn.Module]], built: Sequence[bool]) -> List[str]:
    """One line per module of ``named`` whose flag differs from ``built`` (its flag then)."""
    return [f"'{name or type(m).__name__}' is in {'training' if m.training else 'eval'} mode now, was in "
            f"{'training' if flag else 'eval'} mode at the build" for (name, m), flag in zip(named, built)
            if m.training is not flag]


def listed(changes: List[str]) -> str:
    """The changes as a message lists them: six, then how many more."""
    shown = changes[:6] + ([f"... and {len(changes) - 6} more"] if len(changes) > 6 else [])
    return "\n".join(f"  - {c}" for c in shown)


class ModeFlags:
    """The modules' ``training`` flags as built, when ``baked`` says why the graph holds them
    ('' when it follows them: nothing to check)."""

    def __init__(self, model: nn.Module, baked: str) -> None:
        self.baked = baked
        self._flags: List[Tuple[nn.Module, str, bool]] = (
            [(m, name, m.training) for name, m in model.named_modules() if name] if baked else [])

    def check(self) -> None:
        """Raises :class:`~fxpipe.errors.ModelChangedError` naming the submodules whose mode
        changed since the build (the root's own mode is checked by the caller)."""
        for m, _, flag in self._flags:  # the common case: a loop of identity tests
            if m.training is not flag:
                break
        else:
            return
        changed = mode_changes([(name, m) for m, name, _ in self._flags], [flag for _, _, flag in self._flags])
        raise ModelChangedError(
            f"submodules were switched to another mode after the pipeline was built, and its graph has each "
            f"module's mode baked in ({self.baked}): the switch would be silently ignored. Build the pipeline again "
            "after switching (fxpipe.pipeline(model, ...); it shares the model's parameters), e.g. freeze "
            "BatchNorm or turn dropout off before the build. What changed:\n" + listed(changed), changes=changed)
