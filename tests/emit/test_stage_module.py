"""emit/_stage_module.py on one hand-made stage: the note an error gets, and the source
comments of stage code (test_emit.py checks them on emitted pipelines)."""

import pytest
import torch
from torch import fx, nn

from fxpipe.capture._user_code import source_location
from fxpipe.emit._stage_module import StageModule, annotate_stage_exception, source_comment


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.view(2, 8)  # THE FAILING LINE for inputs not of 4 elements per row pair


def stage() -> StageModule:
    model = Model()
    graph = fx.Tracer().trace(model)
    for node in graph.nodes:  # as the capture records them: the user's frame of each node
        if node.op == "call_method":
            node.meta["stack_trace"] = (f'  File "{__file__}", line 19, in forward\n'
                                        "    return h.view(2, 8)  # THE FAILING LINE")
    return StageModule(model, graph, class_name="Stage1", stage_index=1)


def test_an_error_keeps_its_type_and_traceback_and_gets_a_note():
    s = stage()
    with pytest.raises(RuntimeError) as info:
        s(torch.randn(3, 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "in fxpipe stage 1 (Stage1), generated line" in notes
    assert "view" in notes and "THE FAILING LINE" in notes and __file__ in notes
    assert type(info.value) is RuntimeError
    files = []
    tb = info.value.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert any("<eval_with_key>" in f or "fx" in f for f in files)  # the generated frame is kept


def test_the_note_is_added_once():
    s = stage()
    try:
        s(torch.randn(3, 4))
    except RuntimeError as e:
        before = list(e.__notes__)
        annotate_stage_exception(s, e)
        assert e.__notes__ == before


def test_an_error_from_outside_the_generated_code_says_so():
    s = stage()
    e = ValueError("raised elsewhere")
    annotate_stage_exception(s, e)
    assert e.__notes__ == ["in fxpipe stage 1 (Stage1), outside its generated code"]


def test_source_location_is_the_innermost_user_frame():
    node = fx.Graph().placeholder("x")
    node.meta["stack_trace"] = (
        '  File "/site-packages/torch/nn/modules/module.py", line 1, in _call_impl\n    return f()\n'
        '  File "/home/me/model.py", line 10, in forward\n    h = self.block(x)\n'
        '  File "/home/me/block.py", line 3, in forward\n    return x.relu()\n')
    assert source_location(node) == 'File "/home/me/block.py", line 3, in forward: return x.relu()'
    node.meta["stack_trace"] = None
    assert source_location(node) is None


def test_source_comments_name_the_model_line_above_the_generated_one():
    code = source_comment(stage())
    lines = code.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith("view = "))
    assert lines[i - 1].strip().startswith("# File") and "THE FAILING LINE" in lines[i - 1]
