"""Stash and pop as plain functions, for generated stage code.

``fxpipe.pipeline`` rewrites every value that skips over a stage into ``stash(name, value)``
in the producing stage and ``value = pop(name)`` in the consuming one. These are ordinary
``call_function`` nodes in the stage's fx graph, backed by the same trackers and portals as
``@skippable``: inside the pipeline the value travels through a portal, outside it (calling
the stages one after another by hand) through the thread's default tracker.

Both are opaque to torch.compile (``torch.compiler.disable``): a compiled stage breaks its
graph around them and runs them eagerly. Tracing into them would be wrong, not just slow:
they read the running task's thread-local tracker, and the portal's autograd Functions
(phonies that order the skip's backward, tensors handed from stage to stage by side
effect) cannot be captured in a graph: dynamo either fails on them or drops their
gradients.
"""

from __future__ import annotations

from typing import Optional

import torch.compiler
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


_REASON = "fxpipe portal (stash/pop): thread-local skip tracker and autograd phonies, run eagerly"

# Same names, module and docstrings (functools.wraps): generated code still reads
# ``fxpipe_skip_functional_stash(...)`` and resolves to these wrappers.
stash = torch.compiler.disable(stash, reason=_REASON)
pop = torch.compiler.disable(pop, reason=_REASON)

# Dead-code elimination must never drop a stash: it has no users but matters.
torch.fx.node.has_side_effect(stash)
torch.fx.node.has_side_effect(pop)
