"""torch.compile and fxpipe: compile the stages, never the whole pipeline.

A :class:`~fxpipe.api.Pipeline` call is a schedule, not a computation: micro-batches,
clock cycles, Fork/Join phonies, checkpointing with RNG restore, portals handed from stage
to stage through thread-local skip trackers. Dynamo cannot capture that faithfully (it
fails inside the skip tracker, or would have to graph-break on every step), so
:func:`refuse_whole_pipeline_compile` makes ``torch.compile(pipe)`` -- and any compiled
function that calls a pipeline -- raise :class:`CompileError` at its first call.

What works is compiling each stage: ``for stage in pipe.stages: stage.compile()``. A stage
is a plain ``GraphModule``; its portal calls (``fxpipe.portals.stash`` / ``pop``)
are ``torch.compiler.disable``-d, so the compiled stage breaks its graph around them and
the portals stay exact.
"""

from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from .errors import CompileError

__all__ = ["CompileError", "refuse_whole_pipeline_compile"]

_HOW = (
    "Compile the stages instead and call the pipeline itself uncompiled:\n"
    "    for stage in pipe.stages:\n"
    "        stage.compile()\n"
    "    out = pipe(x)"
)


def _compile_region_active() -> bool:
    """Whether a torch.compile frame callback is installed (as torch's own set_stance checks)."""
    callback = get_eval_frame_callback()
    return callback is not None and callback is not False  # False: torch._dynamo.run (no compiling)


def refuse_whole_pipeline_compile() -> None:
    """Raises :class:`CompileError` when a pipeline is called under ``torch.compile``.

    Two checks, because dynamo sees this function twice: while tracing, ``is_compiling()``
    is true and the ``raise`` makes dynamo give the frame up and run it eagerly; then the
    compile region's frame callback is still installed, and the eager call raises for real.
    Costs one C call per pipeline call otherwise.
    """
    if torch.compiler.is_compiling() or _compile_region_active():
        raise CompileError(
            "torch.compile of a whole fxpipe pipeline is not supported: its runtime (micro-batch "
            "schedule, checkpointing, portals between stages) cannot be captured in a graph.\n" + _HOW
        )
