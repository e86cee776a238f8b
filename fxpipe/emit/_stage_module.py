"""Stage modules whose errors point back at the stage, the generated line and the model.

:class:`StageModule` is a ``torch.fx.GraphModule`` whose ``__call__`` catches any exception
raised while running the stage, finds the failing line of the generated code in the
traceback, maps it to its fx node and that node's recorded ``stack_trace``, and re-raises
*the same exception object* (same type, original traceback) with a note such as::

    in fxpipe stage 2 (Stage2), generated line 14: `conv2 = self.encoder.conv2(relu_1)`;
    original source: File "/path/model.py", line 33, in forward: x = self.conv2(x)
"""

from __future__ import annotations

import linecache
import re
from typing import Any

import torch
import torch.fx

from ..capture._grad_regions import recompile_in_regions
from ..capture._user_code import is_user_file, source_location

__all__ = ["StageModule", "annotate_stage_exception", "source_location", "source_comment"]

_NOTE_PREFIX = "in fxpipe stage "
_DELETE_RE = re.compile(r";\s+(?:[A-Za-z_]\w*\s*=\s*)+None\s*$")


def _node_at_line(module: torch.fx.GraphModule, lineno: int) -> torch.fx.Node | None:
    """The fx node that generated line ``lineno`` of ``module.code``."""
    lineno_map = getattr(module, "_lineno_map", None)
    prologue = getattr(module, "_prologue_start", None)
    if lineno_map is None or prologue is None:
        return None
    idx = lineno_map.get(lineno - prologue)
    if idx is None:
        return None
    nodes = list(module.graph.nodes)
    return nodes[idx] if 0 <= idx < len(nodes) else None


def _generated_line(text: str) -> str:
    return _DELETE_RE.sub("", text.strip())


def _stage_label(module: torch.nn.Module) -> str:
    k = getattr(module, "meta", {}).get("fxpipe_stage")
    name = type(module).__name__
    return f"{_NOTE_PREFIX}{k if k is not None else '?'} ({name})"


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):  # Python 3.10
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]
    else:
        exc.args = exc.args + (note,)


def annotate_stage_exception(module: torch.fx.GraphModule, exc: BaseException) -> None:
    """Add a note to ``exc`` naming the stage, its failing generated line and the original
    model source line. Idempotent; never changes the exception's type or traceback."""
    label = _stage_label(module)
    existing = list(getattr(exc, "__notes__", ())) + [a for a in exc.args if isinstance(a, str)]
    if any(label in text for text in existing):
        return
    forward = getattr(type(module), "forward", None)
    filename = getattr(getattr(forward, "__code__", None), "co_filename", None)
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    if lineno is None:
        _add_note(exc, f"{label}, outside its generated code")
        return
    text = _generated_line(linecache.getline(filename, lineno) or module.code.splitlines()[lineno - 1])
    note = f"{label}, generated line {lineno}: `{text}`"
    node = _node_at_line(module, lineno)
    if node is not None and "fxpipe_portal" in node.meta:
        note += f"; portal {node.meta['fxpipe_portal']!r} ({node.target.__name__})"
    elif node is not None:
        where = source_location(node)
        note += f"; original source: {where}" if where else f"; original source unknown (node {node.name!r})"
    _add_note(exc, note)


def source_comment(module: torch.fx.GraphModule) -> str:
    """``module.code`` with ``# File "...", line N, in fn: code`` comments naming the
    original model source above each run of generated lines that come from it."""
    out: list[str] = []
    previous = None
    for lineno, line in enumerate(module.code.splitlines(), start=1):
        node = _node_at_line(module, lineno)
        where = None
        if node is not None and node.op not in ("placeholder", "output"):
            where = source_location(node)
            if where is None and "fxpipe_portal" in node.meta:
                where = f"portal {node.meta['fxpipe_portal']} ({node.target.__name__})"
        if where is not None and where != previous and line.strip():
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# {where}")
        if where is not None:
            previous = where
        out.append(line)
    return "\n".join(out)


def _rebuild_stage(body: dict[str, Any], import_block: str) -> torch.nn.Module:
    """Unpickle a :class:`StageModule` (fx's ``reduce_graph_module``, keeping the class)."""
    from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src

    stage_index = body.get("meta", {}).get("fxpipe_stage")
    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    module = _deserialize_graph_module(forward, body, graph_module_cls=StageModule)
    if stage_index is not None:
        module.meta["fxpipe_stage"] = stage_index
    return module


def _stage_call(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    try:
        return super(StageModule, self).__call__(*args, **kwargs)
    except Exception as exc:
        annotate_stage_exception(self, exc)
        raise


class StageModule(torch.fx.GraphModule):
    """A pipeline stage: a ``GraphModule`` built on the model (``root``), so its submodules
    and parameters are the model's own objects, whose exceptions carry a note locating
    the failure (see :func:`annotate_stage_exception`).

    ``__call__`` bypasses fx's ``_WrappedCall``, which would drop the traceback when the
    failing frame is the generated code itself; the original traceback is kept.
    """

    def __init__(
        self, root: torch.nn.Module | dict[str, Any], graph: torch.fx.Graph,
        class_name: str = "StageModule", stage_index: int | None = None,
    ) -> None:
        super().__init__(root, graph, class_name)
        if stage_index is not None:
            self.meta["fxpipe_stage"] = stage_index

    @property
    def stage_index(self) -> int | None:
        return self.meta.get("fxpipe_stage")

    def recompile(self) -> Any:
        # nodes traced inside `with torch.no_grad()` etc. run inside it again (fxpipe.capture._grad_regions)
        python_code = recompile_in_regions(self, super().recompile)
        type(self).__call__ = _stage_call  # replaces fx's call_wrapped
        return python_code

    def __reduce__(self) -> tuple[Any, ...]:
        reduced = super().__reduce__()
        try:
            from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src  # noqa: F401
        except ImportError:  # pragma: no cover - private fx API moved: plain GraphModule
            return reduced
        body, import_block = reduced[1]
        body["_graphmodule_cls_name"] = type(self).__name__
        return (_rebuild_stage, (body, import_block))

    def _deepcopy_init(self) -> Any:
        class_name = type(self).__name__

        def init(res: torch.fx.GraphModule, fake_mod: Any, graph: torch.fx.Graph) -> None:
            torch.fx.GraphModule.__init__(res, fake_mod, graph, class_name)

        return init
