"""fxpipe: automatic GPipe pipeline parallelism for any nn.Module.

* ``fxpipe.pipeline(model, sample, n_stages, ...)`` -- trace any module, balance it, portal
  its long edges, and run the generated stages on the GPipe runtime;
* ``fxpipe.GPipe(nn.Sequential, balance, ...)`` -- the torchgpipe-compatible API;
* ``fxpipe.skip`` -- ``@skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``;
* ``fxpipe.balance`` -- ``balance_by_time``, ``balance_by_size``;
* ``fxpipe.tune(model, sample, devices, memory)`` -- stages, micro-batches, schedule and
  checkpointing predicted and ranked (``fxpipe.tuning.Tuning``);
* ``fxpipe.errors`` -- every error fxpipe raises on purpose (all subclass ``FxpipeError`` and
  the builtin a caller would catch);
* ``fxpipe.plan.Plan``, ``fxpipe.distributed`` (``pipeline``, ``trace.record``),
  ``fxpipe.batchnorm``, ``fxpipe.progress.Progress``.

That is the public surface, with what docs/api.md documents. As in torch, a module whose name
starts with ``_`` is private (every module inside ``capture/``, ``checks/``, ``plan/``,
``emit/``, ``runtime/``, ``cli/`` and ``distributed/``, but ``distributed/trace.py``): its
names may change without notice; the packages' ``__init__`` say what they hold.

Everything that needs torch is imported on first use (module ``__getattr__``), so the pure
planning modules (``import fxpipe.plan``) load on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import Any, List

from . import errors
from .errors import (
    CompileError, FxpipeError, InputMismatchError, MicroBatchError, ModelChangedError, MutationError,
    PipelineClosedError, PlanError, TraceError,
)

__version__ = "0.1.0"

__all__ = [
    "pipeline", "Pipeline", "Plan", "GPipe", "tune", "is_checkpointing", "is_recomputing", "balance", "skip",
    "errors", "FxpipeError", "TraceError", "MicroBatchError", "MutationError", "InputMismatchError",
    "PlanError", "PipelineClosedError", "CompileError", "ModelChangedError", "__version__",
]

# name -> the module defining it; a name mapped to None is a submodule of its own.
_LAZY = {
    "pipeline": ".api", "Pipeline": ".api",
    "Plan": ".plan",
    "GPipe": ".gpipe",
    "is_checkpointing": ".runtime._checkpoint", "is_recomputing": ".runtime._checkpoint",
    "balance": None, "skip": None,
    "tune": ".tuning",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _LAZY[name]
    if where is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
