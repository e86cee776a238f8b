"""A plan given by the user (a loaded plan, split points) must keep together what the capture
tied: the readers and writers of an updated buffer, an op and the copy it fills
(:mod:`fxpipe.capture._mutation` marks them, ``KEEP_WITH``)."""

from __future__ import annotations

from typing import Dict

from torch import fx

from ..errors import MutationError
from ._mutation import KEEP_REASON, KEEP_WITH, MUTATES_STATE, _where

__all__ = ["check_kept_together"]


def check_kept_together(gm: fx.GraphModule, assignment: Dict[str, int]) -> None:
    """Refuses an assignment (a loaded plan, split points) that separates nodes which must
    share a stage: the readers and writers of an updated buffer, an op and the copy it fills."""
    for node in gm.graph.nodes:
        for other in node.meta.get(KEEP_WITH, ()):
            if node.name in assignment and other in assignment and assignment[node.name] != assignment[other]:
                what = node.meta.get(MUTATES_STATE) or ["a copy made for an in-place op"]
                why = node.meta.get(KEEP_REASON) or f"they touch {what}"
                raise MutationError(
                    f"the plan puts {node.name!r} in stage {assignment[node.name]} and {other!r} in stage "
                    f"{assignment[other]}, but they must share a stage: {why} ({_where(node)}). "
                    "What to do: make a new plan (omit plan=), or choose split points outside that group.",
                    node=node.name)
