"""``stash`` and ``pop``: the portal calls in generated stage code.

``fxpipe.pipeline`` writes every value that skips over a stage (a portal route of the plan)
as ``stash(name, value)`` in the producing stage and ``value = pop(name)`` in the consuming
one. These are ordinary ``call_function`` nodes in the stage's fx graph, served by
:mod:`fxpipe.runtime._stage_portals`: inside the pipeline the value travels through a portal,
outside it (calling the stages one after another by hand) through a per-thread dict.
(``@skippable`` modules have their own ``stash``/``pop`` commands, in :mod:`fxpipe.skip`.)

Both are opaque to torch.compile (``torch.compiler.disable``): a compiled stage breaks its
graph around them and runs them eagerly. Tracing into them would be wrong, not just slow:
they read the running task's thread-local tracker, and the portal's autograd Functions
(phonies that order the skip's backward, tensors handed from stage to stage by side
effect) cannot be captured in a graph: dynamo either fails on them or drops their
gradients.
"""

from __future__ import annotations

from typing import Any

import torch.compiler
import torch.fx

from .runtime._stage_portals import current_portals

__all__ = ["stash", "pop"]


def stash(name: str, value: Any) -> None:
    """Hands ``value`` to the portal named ``name``; a later stage pops it."""
    current_portals().stash(name, value)


def pop(name: str) -> Any:
    """Takes the value stashed under ``name`` by an earlier stage."""
    try:
        return current_portals().pop(name)
    except KeyError:
        raise RuntimeError(
            f"portal '{name}' has not been stashed: the stage that produces it must run first, "
            "for the same micro-batch"
        ) from None


_REASON = "fxpipe portal (stash/pop): thread-local portals and autograd phonies, run eagerly"

# Same names, module and docstrings (functools.wraps): generated code still reads
# ``fxpipe_portals_stash(...)`` and resolves to these wrappers.
stash = torch.compiler.disable(stash, reason=_REASON)
pop = torch.compiler.disable(pop, reason=_REASON)

# Dead-code elimination must never drop a stash: it has no users but matters.
torch.fx.node.has_side_effect(stash)
torch.fx.node.has_side_effect(pop)
