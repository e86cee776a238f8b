"""The model after a distributed build, run eagerly: refused by name until it is whole again.

After :func:`fxpipe.distributed.pipeline` a rank holds only its own stages' weights: the other
ranks' are on the meta device (:mod:`._weights`), and under ``data_parallel='fsdp'`` its own are
DTensor shards (:mod:`._sharding`). ``model(x)`` then failed deep inside torch ("Tensor on
device meta is not on the expected device", or a DTensor mixed with plain tensors), naming
neither the cause nor what to do. A forward pre-hook on the model's root says both, as a
:class:`~fxpipe.errors.DistributedError`; it removes itself at the first call that finds the
model whole (its weights given back), and before another build captures the model (so no
capture ever traces it). The pipeline's own stages never call the root, so the hook costs them
nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fxpipe.capture._hooks import FXPIPE_GUARD
from fxpipe.errors import DistributedError

from ._sharding import is_sharded

__all__ = ["guard_eager", "unguard_eager"]

def _not_whole(model: nn.Module) -> Optional[tuple[str, str]]:
    """``(name, why)`` of the first tensor that keeps ``model`` from running on this rank alone."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if any(not t.is_meta for _, t in tensors):  # a model built on meta and never loaded is the user's own
        for name, t in tensors:
            if is_sharded(t):
                return name, "is this rank's shard of it (data_parallel='fsdp')"
            if t.is_meta:
                return name, "was released to the meta device: only the ranks whose stages use it hold it"
    return None


def _refuse(model: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    found = _not_whole(model)
    if found is None:
        unguard_eager(model)
        return
    name, why = found
    raise DistributedError(
        f"{type(model).__name__} was called eagerly on this rank after fxpipe.distributed.pipeline, which keeps only "
        f"this rank's stages: {name!r} {why}. Evaluate with pipe.eval_step(...). To run the whole model on one "
        "process, save pipe.state_dict() on every rank with torch.distributed.checkpoint and load it into a fresh "
        "model (dcp.load(fresh.state_dict(), checkpoint_id=...)); building another pipeline from this model gathers "
        "the released weights itself.")


setattr(_refuse, FXPIPE_GUARD, True)  # not a hook of the user's: the model's change check passes it


def guard_eager(model: nn.Module) -> None:
    """Until the model is whole again, ``model(...)`` raises naming what this rank lacks."""
    if _refuse not in model._forward_pre_hooks.values() and _not_whole(model) is not None:
        model.register_forward_pre_hook(_refuse)


def unguard_eager(model: nn.Module) -> None:
    """The hook of :func:`guard_eager` removed (a new build is about to capture the model; a
    copy of the model, ``copy.deepcopy``'s or pickle's, carries it too, and is found the same way)."""
    for key in [k for k, hook in model._forward_pre_hooks.items() if hook is _refuse]:
        del model._forward_pre_hooks[key]
