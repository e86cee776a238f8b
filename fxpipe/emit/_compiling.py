"""torch.compile and fxpipe: compile the stages, never the whole pipeline.

A :class:`~fxpipe.api.Pipeline` call is a schedule, not a computation: micro-batches,
clock cycles, Fork/Join phonies, checkpointing with RNG restore, portals handed from stage
to stage through thread-local skip trackers. Dynamo cannot capture that faithfully (it
fails inside the skip tracker, or would have to graph-break on every step), so
:func:`refuse_whole_pipeline_compile` makes ``torch.compile(pipe)`` -- and any compiled
function that calls a pipeline -- raise :class:`CompileError` at its first call.

What works is compiling each stage: ``fxpipe.pipeline(..., compile=True)`` (or by hand,
``for stage in pipe.stages: stage.compile()``). A stage is a plain ``GraphModule``; its
portal calls (``fxpipe.portals.stash`` / ``pop``) are ``torch.compiler.disable``-d, so the
compiled stage breaks its graph around them and the portals stay exact. Phonies, copies and
checkpoint boundaries live in the runtime, outside the stage's ``forward``, so they are
never compiled: a checkpointed micro-batch recomputes by calling the compiled stage again.

CUDA graphs (``mode='reduce-overhead'`` or ``'max-autotune'``, or inductor's
``triton.cudagraphs`` option) replay a stage from inductor's CUDA graph trees, whose state
lives in thread-local storage. fxpipe runs each device's stages on a worker thread; before
torch's fix (pytorch#123177, in torch 2.13) a thread that did not set that state up stopped
on ``AssertionError`` in ``cudagraph_trees.get_obj`` (measured on torch 2.11, issue 21).
:func:`check_graph_replay` refuses that combination at build time, naming the working modes.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping, Union

import torch
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from ..errors import ArgumentError, CompileError

__all__ = ["CompileError", "CompileOption", "check_compile_option", "compile_stages",
           "refuse_whole_pipeline_compile", "check_graph_replay", "uses_cuda_graphs"]

_HOW = (
    "Compile the stages instead and call the pipeline itself uncompiled:\n"
    "    pipe = fxpipe.pipeline(model, sample, n_stages, compile=True)   # or compile={'mode': ...}\n"
    "    out = pipe(x)\n"
    "or, on a pipeline already built: for stage in pipe.stages: stage.compile()"
)

#: ``compile=`` of :func:`fxpipe.pipeline`: off, on with torch.compile's defaults, or the
#: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``options``, ...)
CompileOption = Union[bool, Mapping[str, Any]]

_COMPILE_KEYWORDS = frozenset(p for p in inspect.signature(torch.compile).parameters if p != "model")


def check_compile_option(option: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments ``option`` asks for, ``None`` for no compiling.

    Raises :class:`ArgumentError` for anything but a bool or a mapping of torch.compile's
    own keywords, naming the unknown ones, before anything is built."""
    if isinstance(option, bool):
        return {} if option else None
    if isinstance(option, Mapping):
        unknown = sorted(str(k) for k in option if k not in _COMPILE_KEYWORDS)
        if unknown:
            raise ArgumentError(
                f"compile={dict(option)!r} has keys torch.compile does not take: {unknown}; pass compile=True, or "
                f"a dict of torch.compile's keyword arguments ({', '.join(sorted(_COMPILE_KEYWORDS))})",
                argument="compile")
        return dict(option)
    raise ArgumentError(f"compile must be True, False or a dict of torch.compile keyword arguments, got "
                        f"compile={option!r}", argument="compile")


#: torch.compile modes whose inductor backend records CUDA graphs by default
_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


def uses_cuda_graphs(options: Mapping[str, Any]) -> bool:
    """Whether ``torch.compile(**options)`` replays CUDA graphs on a GPU: inductor's
    ``triton.cudagraphs`` option when given, else the mode."""
    if options.get("backend", "inductor") != "inductor":
        return False
    extra = options.get("options") or {}
    if "triton.cudagraphs" in extra:
        return bool(extra["triton.cudagraphs"])
    return options.get("mode") in _GRAPH_MODES


def threads_replay_graphs() -> bool:
    """Whether this torch's CUDA graph trees set up their thread-local state in any thread
    (pytorch#123177's fix: ``cudagraph_trees._initialize_tls``)."""
    from torch._inductor import cudagraph_trees

    return hasattr(cudagraph_trees, "_initialize_tls")


def check_graph_replay(options: Mapping[str, Any] | None, devices: Iterable[torch.device]) -> None:
    """Refuses, before anything is built, CUDA graphs on GPU stages with a torch whose graph
    trees fail on fxpipe's worker threads (:class:`CompileError`, with what works instead)."""
    if options is None or not uses_cuda_graphs(options):
        return
    if not any(torch.device(d).type == "cuda" for d in devices) or threads_replay_graphs():
        return
    raise CompileError(
        f"compile={dict(options)!r} replays CUDA graphs, and this torch ({torch.__version__}) keeps their state per "
        "thread in a way that fails on the worker threads fxpipe runs stages on (AssertionError in "
        "torch._inductor.cudagraph_trees; fixed in torch 2.13, pytorch#123177). Use compile=True or "
        "compile={'mode': 'max-autotune-no-cudagraphs'}, or upgrade torch to 2.13 or later.")


def compile_stages(stages: Iterable[nn.Module], options: Mapping[str, Any]) -> None:
    """Compiles each stage's ``forward`` in place (``nn.Module.compile``): the stage keeps
    its parameters (the model's own), and the runtime around it stays eager."""
    for stage in stages:
        stage.compile(**options)


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
