"""stage_module on its own: what an error raised inside a stage carries, and what it keeps.

test_emit.py checks notes through emitted pipelines. Here one StageModule is built by hand
from a captured graph, so each part of the contract is isolated: the very exception object
is re-raised (type, arguments and traceback untouched) with one note naming the stage, the
generated line (without fx's ``x = None`` clean-ups) and the model's source line, also for a
node run inside a ``torch.no_grad()`` region (whose generated code differs from the graph);
the note is added once however often the exception passes a stage; and the fallbacks say
what they know: no stage index, no recorded source, a failure outside the generated code.
"""

from __future__ import annotations

import copy
import inspect
import re
import traceback

import pytest
import torch
from torch import nn

from fxpipe.capture._tracing import capture
from fxpipe.emit._stage_module import StageModule, annotate_stage_exception, source_comment

THIS_FILE = __file__


class Boom(Exception):
    pass


class Halt(BaseException):
    """Not an Exception: like KeyboardInterrupt, it must pass through untouched."""


class Picky(nn.Module):
    """A leaf that raises whatever exception object it was given, when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.raise_: BaseException | None = None

    def forward(self, x):
        if self.raise_ is not None:
            raise self.raise_
        return x * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.picky = Picky()

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        with torch.no_grad():
            g = self.b(y)
        return self.picky(h + g)


def _line(text: str) -> int:
    """The line number of ``text`` in Net.forward."""
    src, first = inspect.getsourcelines(Net.forward)
    return first + next(i for i, line in enumerate(src) if text in line)


def _stage(index: int | None = 3, class_name: str = "Stage3") -> tuple[Net, StageModule]:
    model = Net()
    gm = capture(model, (torch.randn(2, 4), torch.randn(2, 4)), leaf_modules=[Picky]).graph_module
    return model, StageModule(gm, copy.deepcopy(gm.graph), class_name=class_name, stage_index=index)


def _notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", []) if "in fxpipe stage" in n]


def _parse(note: str) -> tuple[str, int, str, str]:
    m = re.fullmatch(r"in fxpipe stage (\S+) \((\w+)\), generated line (\d+): `(.+?)`; (.*)", note)
    assert m, note
    return m.group(2), int(m.group(3)), m.group(4), m.group(5)


def test_the_same_exception_object_is_reraised_with_one_note() -> None:
    model, stage = _stage()
    exc = Boom("bad width", 3)
    model.picky.raise_ = exc
    with pytest.raises(Boom) as info:
        stage(torch.randn(2, 4), torch.randn(2, 4))
    assert info.value is exc and info.value.args == ("bad width", 3)
    (note,) = _notes(exc)
    name, lineno, text, rest = _parse(note)
    assert name == "Stage3" and note.startswith("in fxpipe stage 3 (Stage3)")
    assert text == "picky = self.picky(add)"
    # the generated line the note names is the one that ran, without fx's `add = None`
    assert stage.code.splitlines()[lineno - 1].strip() == "picky = self.picky(add);  add = None"
    assert rest == f'original source: File "{THIS_FILE}", line {_line("return self.picky")}, in forward: ' \
                   "return self.picky(h + g)"
    # the original traceback is kept, down to the frame that raised
    frames = [f.f_code.co_name for f, _ in traceback.walk_tb(exc.__traceback__)]
    assert frames[-1] == "forward" and any(f.f_code.co_filename == THIS_FILE and f.f_code.co_name == "forward"
                                           for f, _ in traceback.walk_tb(exc.__traceback__))


def test_an_error_inside_a_no_grad_region_points_at_its_own_node() -> None:
    # the region's node runs through a wrapper (generated from a copy of the graph): the
    # generated line must still map back to the right node and source
    _, stage = _stage()
    with pytest.raises(RuntimeError) as info:
        stage(torch.randn(2, 4), torch.randn(2, 5))  # y too wide for self.b
    assert type(info.value) is RuntimeError
    _, lineno, text, rest = _parse(_notes(info.value)[0])
    assert text == "b = fxpipe_no_grad__call(self.b, y)"
    assert rest.endswith(f'line {_line("g = self.b(y)")}, in forward: g = self.b(y)'), rest


def test_the_note_is_added_once() -> None:
    model, stage = _stage()
    exc = Boom("again")
    model.picky.raise_ = exc
    for _ in range(2):  # the same object raised through the stage twice
        with pytest.raises(Boom):
            stage(torch.randn(2, 4), torch.randn(2, 4))
    annotate_stage_exception(stage, exc)
    assert len(_notes(exc)) == 1
    # another stage it passes through adds its own
    _, other = _stage(4, "Stage4")
    annotate_stage_exception(other, exc)
    assert [n.split(",")[0] for n in _notes(exc)] == ["in fxpipe stage 3 (Stage3)",
                                                       "in fxpipe stage 4 (Stage4)"]


def test_base_exceptions_pass_through_untouched() -> None:
    model, stage = _stage()
    model.picky.raise_ = Halt()
    with pytest.raises(Halt) as info:
        stage(torch.randn(2, 4), torch.randn(2, 4))
    assert not hasattr(info.value, "__notes__")


def test_what_the_note_says_when_it_knows_less() -> None:
    # no stage index
    model, stage = _stage(None, "Loose")
    model.picky.raise_ = Boom()
    with pytest.raises(Boom) as info:
        stage(torch.randn(2, 4), torch.randn(2, 4))
    assert _notes(info.value)[0].startswith("in fxpipe stage ? (Loose), generated line")
    # no recorded source for the failing node
    model, stage = _stage()
    for node in stage.graph.nodes:
        node.meta.pop("stack_trace", None)
    model.picky.raise_ = Boom()
    with pytest.raises(Boom) as info:
        stage(torch.randn(2, 4), torch.randn(2, 4))
    assert _notes(info.value)[0].endswith("; original source unknown (node 'picky')")
    # a failure that never ran the generated code
    exc = ValueError("from elsewhere")
    annotate_stage_exception(stage, exc)
    assert _notes(exc) == ["in fxpipe stage 3 (Stage3), outside its generated code"]


def test_a_working_stage_is_the_graph() -> None:
    model, stage = _stage()
    assert stage.stage_index == 3 and type(stage).__name__ == "Stage3"
    assert stage.get_submodule("a") is model.a  # the model's own submodules
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(stage(x, y)[0], model(x, y))


def test_source_comment_names_the_model_line_above_each_run() -> None:
    _, stage = _stage()
    lines = source_comment(stage).splitlines()
    comments = [i for i, line in enumerate(lines) if line.strip().startswith("# File")]
    assert [lines[i].strip() for i in comments] == [
        f'# File "{THIS_FILE}", line {_line(text)}, in forward: {text}'
        for text in ("h = torch.relu(self.a(x))", "g = self.b(y)", "return self.picky(h + g)")]
    # each comment sits right above the first generated line of its run
    assert [lines[i + 1].strip().split(" =")[0] for i in comments] == ["a", "b", "add"]
    assert [line for line in lines if not line.strip().startswith("# File")] == stage.code.splitlines()
