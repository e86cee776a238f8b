"""``torch.utils.checkpoint(..., use_reentrant=True)`` inside a model being captured.

The re-entrant checkpoint runs its function under ``torch.no_grad()`` inside an autograd
Function and makes the gradients in its own backward. A graph capture sees only the
no_grad forward: torch.fx records a no_grad region (every parameter inside would get no
gradient, silently) and torch.export a graph whose outputs need no grad. Neither can be
made exact, so while fxpipe captures, ``CheckpointFunction.apply`` raises
:class:`ReentrantCheckpointError` instead. Under torch.fx that failure keeps the calling
module opaque (it then runs its own forward, re-entrant checkpoint included, eagerly in its
stage: exact); where nothing can be opaque (the root forward, a torch.export capture) the
error reaches the user with what to do. Non-reentrant checkpointing (``use_reentrant=False``,
saved-tensor hooks) traces like any other code and is not affected.
"""

from __future__ import annotations

from typing import Any

from torch.utils import checkpoint as torch_checkpoint

from ..errors import TraceError
from ._apply_patch import ApplyPatch, error_in_chain
from ._user_code import user_line

__all__ = ["ReentrantCheckpointError", "reentrant_checkpoint_in", "refusing_reentrant_checkpoint"]

class ReentrantCheckpointError(TraceError):
    """The model calls ``torch.utils.checkpoint`` with ``use_reentrant=True``."""


def _refusing_apply(patch: ApplyPatch, cls: type, *args: Any, **kwargs: Any) -> Any:
    if not patch.state:  # another thread, not capturing: torch's own
        return patch.original(cls, *args, **kwargs)
    location = user_line()
    raise ReentrantCheckpointError(
        "the model calls torch.utils.checkpoint with use_reentrant=True"
        + (f" ({location})" if location else "")
        + ": that checkpoint runs its function under no_grad and makes the gradients in a backward "
        "of its own, which no graph capture can reproduce (the parameters inside would get no "
        "gradient). What to do: pass use_reentrant=False (transformers: model.gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})), or turn the model's own checkpointing "
        "off and let the pipeline recompute (fxpipe.pipeline(..., checkpoint='except_last' or 'always')).",
        location=location, reason="torch.utils.checkpoint(use_reentrant=True)")


def reentrant_checkpoint_in(error: BaseException | None) -> ReentrantCheckpointError | None:
    """The :class:`ReentrantCheckpointError` behind a capture failure, if any (torch.export
    may wrap or chain it)."""
    return error_in_chain(error, ReentrantCheckpointError)


_PATCH = ApplyPatch(torch_checkpoint.CheckpointFunction, _refusing_apply)


def refusing_reentrant_checkpoint() -> Any:
    """While the block runs, the re-entrant checkpoint raises :class:`ReentrantCheckpointError`
    on this thread (other threads keep torch's own). Nests; restores torch's class after."""
    return _PATCH.active(True)
