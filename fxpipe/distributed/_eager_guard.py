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

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn

from fxpipe.capture._hooks import FXPIPE_GUARD
from fxpipe.errors import DistributedError

from ._sharding import is_sharded

__all__ = ["guard_eager", "unguard_eager", "own_state_dict"]

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


_INTERNAL = threading.local()


@contextmanager
def own_state_dict() -> Iterator[None]:
    """fxpipe's own reads of the model's state_dict (``pipe.state_dict()``): not warned."""
    before = getattr(_INTERNAL, "on", False)
    _INTERNAL.on = True
    try:
        yield
    finally:
        _INTERNAL.on = before


def _warn_released(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``model.state_dict()`` on a rank holding only its stages: the other ranks' tensors are on
    meta, so ``torch.save`` of it kept no values for them and loading it failed with torch's
    'Cannot copy out of meta tensor', after the run (a trial). Said when it is taken."""
    if prefix or getattr(_INTERNAL, "on", False):
        return
    released = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_meta]
    if released:
        warnings.warn(
            f"fxpipe.distributed: {type(module).__name__}.state_dict() on this rank holds {len(released)} of "
            f"{len(state_dict)} tensors on the meta device ({released[0]!r}, ...): the other ranks' stages, without "
            "values. Saved, it cannot be loaded. Save pipe.state_dict() on every rank with "
            "torch.distributed.checkpoint (dcp.save), and load it into a fresh model (dcp.load).", stacklevel=2)


setattr(_refuse, FXPIPE_GUARD, True)  # not a hook of the user's: the model's change check passes it


def guard_eager(model: nn.Module) -> None:
    """Until the model is whole again, ``model(...)`` raises naming what this rank lacks, and
    ``model.state_dict()`` warns that it holds released tensors."""
    if _refuse not in model._forward_pre_hooks.values() and _not_whole(model) is not None:
        model.register_forward_pre_hook(_refuse)
        if _warn_released not in model._state_dict_hooks.values():
            model._register_state_dict_hook(_warn_released)


def unguard_eager(model: nn.Module) -> None:
    """The hooks of :func:`guard_eager` removed (a new build is about to capture the model; a
    copy of the model, ``copy.deepcopy``'s or pickle's, carries them too, and is found the same way)."""
    for key in [k for k, hook in model._forward_pre_hooks.items() if hook is _refuse]:
        del model._forward_pre_hooks[key]
    for key in [k for k, hook in model._state_dict_hooks.items() if hook is _warn_released]:
        del model._state_dict_hooks[key]
