"""fxpipe: automatic GPipe pipeline parallelism for any nn.Module.

* ``fxpipe.pipeline(model, sample, n_stages, ...)`` -- trace any module, balance it, portal
  its long edges, and run the generated stages on the GPipe runtime;
* ``fxpipe.GPipe(nn.Sequential, balance, ...)`` -- the torchgpipe-compatible API;
* ``fxpipe.skip`` -- ``@skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``;
* ``fxpipe.balance`` -- ``balance_by_time``, ``balance_by_size``;
* ``fxpipe.errors`` -- every error fxpipe raises on purpose (all subclass ``FxpipeError`` and
  the builtin a caller would catch).
"""

from . import balance, errors, skip
from .api import Pipeline, pipeline
from .errors import (
    CompileError, FxpipeError, InputMismatchError, MicroBatchError, MutationError, PipelineClosedError,
    PlanError, TraceError,
)
from .gpipe import GPipe
from .plan import Plan
from .runtime.checkpoint import is_checkpointing, is_recomputing

__version__ = "0.1.0"

__all__ = [
    "pipeline", "Pipeline", "Plan", "GPipe", "is_checkpointing", "is_recomputing", "balance", "skip",
    "errors", "FxpipeError", "TraceError", "MicroBatchError", "MutationError", "InputMismatchError",
    "PlanError", "PipelineClosedError", "CompileError", "__version__",
]
