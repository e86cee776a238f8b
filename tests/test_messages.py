"""Error messages for what users get wrong: calls that do not fit the sample, plan files,
factories that exit (issue #8, items 11-13).

Each test checks the error's type (an :class:`fxpipe.FxpipeError` that is also the builtin a
caller would catch) and the words that make it actionable: the argument or file it is about
and what to do.
"""

from __future__ import annotations

import ast
import json
import os
import textwrap

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.capture._tracing import capture
from fxpipe.cli._main import main
from fxpipe.errors import (ArgumentError, ChunksError, DevicesError, FxpipeError, InputMismatchError, PlanError,
                           PlanFileError, PlanModelError, PlanNotFoundError, PlanPathError, SplitPointsError,
                           StagesError)
from fxpipe.plan._value import Plan


# -- item 11: a call structured differently from the sample ----------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, y=None, mask=None, pair=None, extras=None, scale=1.0):
        h = self.a(x)
        if y is not None:
            h = h + y
        if mask is not None:
            h = h * mask
        if pair is not None:
            h = h + pair[0] * pair[1]
        if extras is not None:
            h = h + extras["bias"]
        return self.b(h) * scale


X, Y, M = torch.randn(4, 4), torch.randn(4, 4), torch.ones(4, 4)
KW = {"pair": (X, Y), "extras": {"bias": Y}, "scale": 0.5}


@pytest.fixture(scope="module")
def pipes():
    model = Net()
    build = dict(n_stages=2, balance_by="params", chunks=2)
    return {
        "model": model,
        # x, y positional; pair, extras, scale by keyword
        "pos": fxpipe.pipeline(model, (X, Y), sample_kwargs=dict(KW), **build),
        # everything by keyword
        "kw": fxpipe.pipeline(model, (), sample_kwargs={"x": X, "mask": M}, **build),
        # x alone: no mask
        "bare": fxpipe.pipeline(model, X, **build),
    }


def test_matching_calls_run(pipes):
    model = pipes["model"]
    torch.testing.assert_close(pipes["pos"](X, Y, **KW), model(X, Y, **KW))
    torch.testing.assert_close(pipes["kw"](x=X, mask=M), model(x=X, mask=M))
    torch.testing.assert_close(pipes["bare"](X), model(X))


def test_keywords_in_any_order(pipes):
    """Named parameters bind by name: a call may give them in another order than the sample."""
    model = pipes["model"]
    torch.testing.assert_close(pipes["kw"](mask=M, x=X), model(x=X, mask=M))
    swapped = {"scale": 0.5, "extras": {"bias": Y}, "pair": (X, Y)}
    torch.testing.assert_close(pipes["pos"](X, Y, **swapped), model(X, Y, **KW))
    # missing and extra names are still named, whatever the order
    with pytest.raises(InputMismatchError, match="mask= is missing"):
        pipes["kw"](x=X)
    with pytest.raises(InputMismatchError) as info:
        pipes["pos"](X, Y, scale=0.5, mask=M, pair=(X, Y), extras={"bias": Y})
    assert "mask= is passed" in str(info.value) and "order" not in str(info.value)


def test_var_keyword_order_is_kept():
    """Keywords that land in **kwargs reach forward in call order (which its code may read):
    another order than the sample's is refused, naming them, not silently reordered."""
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, **parts):
            return self.l(x) + torch.cat(list(parts.values()), dim=1)[:, :4]

    model = Stack()
    pipe = fxpipe.pipeline(model, X, 2, sample_kwargs={"a": X, "b": Y}, balance_by="params", chunks=2)
    torch.testing.assert_close(pipe(X, a=X, b=Y), model(X, a=X, b=Y))
    with pytest.raises(InputMismatchError) as info:
        pipe(X, b=Y, a=X)
    msg = str(info.value)
    assert "a, b" in msg and "b, a" in msg and "**kwargs" in msg and "sample's order" in msg, msg


CASES = [
    # (pipeline, args, kwargs, words the message must contain)
    ("pos", (X,), KW, ["positional argument y is missing", "pass y"]),
    ("bare", (X, Y), {}, ["y is passed positionally", "sample", "sample=("]),
    ("pos", (X, Y, X, X, X, X, X), KW, ["Net.forward takes 6 positional arguments", "passes 7",
                                        "remove the extra"]),
    ("pos", (X, Y), {**KW, "mask": M}, ["mask= is passed", "sample_kwargs={'mask': ...}"]),
    ("pos", (X, Y), {**KW, "dropout": 0.1}, ["no parameter 'dropout'", "remove dropout="]),
    ("pos", (X,), {**KW, "y": Y}, ["y is passed by keyword", "pass y positionally, as in the sample"]),
    ("kw", (X,), {"mask": M}, ["x is passed positionally", "by keyword", "pass it as x=..."]),
    ("pos", ([X, X], Y), KW, ["x is a list of 2 items", "sample passed a tensor", "pass a tensor for x"]),
    ("pos", (X, Y), {**KW, "pair": (X, Y, X)}, ["pair is a tuple of 3 items", "tuple of 2 items",
                                                "pass pair with 2 items"]),
    ("pos", (X, Y), {**KW, "extras": {"bias": Y, "gain": X}}, ["extras has keys ['bias', 'gain']",
                                                               "unexpected ['gain']", "sample's keys"]),
    ("pos", (X, Y), {**KW, "extras": {"gain": X}}, ["missing ['bias']", "unexpected ['gain']"]),
    ("pos", (X, Y), {**KW, "pair": (X, 3)}, ["pair[1] is 3 (int)", "sample passed a tensor",
                                             "pass a tensor for pair[1]"]),
    ("bare", (X,), {"mask": None}, ["mask=None is passed", "leave mask out",
                                    "sample_kwargs={'mask': None, ...}"]),
    ("kw", (), {"x": X, "mask": None}, ["mask is None", "sample passed a tensor", "pass a tensor for mask"]),
    ("kw", (), {"x": X}, ["mask= is missing", "sample passed mask (a tensor)", "pass mask=..."]),
]


@pytest.mark.parametrize("which, args, kwargs, words", CASES, ids=[" ".join(c[3][0].split()[:4]) for c in CASES])
def test_call_mismatch_names_the_argument(pipes, which, args, kwargs, words):
    with pytest.raises(InputMismatchError) as info:
        pipes[which](*args, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FxpipeError)
    msg = str(info.value)
    assert msg.startswith("Net: this call does not match the sample")
    for word in words:
        assert word in msg, msg
    assert "TreeSpec" not in msg and "leaf" not in msg, msg


def test_specialised_value_names_the_argument(pipes):
    with pytest.raises(InputMismatchError, match="specialised") as info:
        pipes["pos"](X, Y, **{**KW, "scale": 2.0})
    msg = str(info.value)
    assert "scale is 2.0" in msg and "sample's 0.5" in msg and "pass 0.5 for scale" in msg
    assert "input leaf" not in msg


def test_several_mismatches_are_listed_together(pipes):
    with pytest.raises(InputMismatchError) as info:
        pipes["pos"](X, **{**KW, "scale": 3.0, "pair": [X, Y]})
    lines = str(info.value).splitlines()
    assert len(lines) == 4 and all(ln.startswith("  - ") for ln in lines[1:])
    assert "y is missing" in lines[1] and "pair is a list" in lines[2] and "scale is 3.0" in lines[3]


def test_var_positional_and_capture_level_messages():
    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, *xs):
            return self.l(sum(xs))

    c = capture(Sum(), (X, Y))
    assert len(c.flatten_inputs((X, Y))) == 2
    with pytest.raises(InputMismatchError, match=r"positional argument xs\[1\] is missing"):
        c.flatten_inputs((X,))
    with pytest.raises(InputMismatchError, match=r"xs\[2\] is passed positionally"):
        c.flatten_inputs((X, Y, X))


# -- item 12: plan files -------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = fxpipe.pipeline(model, torch.randn(4, 4), 2, balance_by="params")
    return model, pipe.plan


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_plan_round_trip_through_pipeline(tmp_path, plan_model):
    model, plan = plan_model
    path = str(tmp_path / "plan.json")
    plan.save(path)
    again = fxpipe.pipeline(model, torch.randn(4, 4), 2, plan=path)
    assert again.plan == plan


@pytest.mark.parametrize("how, err, builtin, words", [
    ("truncated", PlanError, ValueError, ["not valid JSON", "it looks truncated", "plan.save(path)", "omit plan="]),
    ("empty", PlanError, ValueError, ["is empty", "plan.save(path)"]),
    ("not a plan", PlanError, ValueError, ["not an fxpipe plan", "expected 'fxpipe.plan._value/1'", "plan.save(path)"]),
    ("a list", PlanError, ValueError, ["not an fxpipe plan", "JSON list"]),
    ("missing keys", PlanError, ValueError, ["not a complete fxpipe plan", "'assignment', 'edges'"]),
    ("wrong type", PlanError, ValueError, ["'stages' must be a list, got dict"]),
    ("stage out of range", PlanError, ValueError, ["has stage 5, not in 0..1"]),
    ("bad stage entry", PlanError, ValueError, ["stages[0] is not a StageInfo", "no 'cost'"]),
    ("directory", PlanFileError, OSError, ["is a directory", "plan.save(path)"]),
    ("missing file", PlanNotFoundError, FileNotFoundError, ["no such file", "make a new plan", "omit plan="]),
])
def test_plan_load_errors_name_the_file(tmp_path, plan_model, how, err, builtin, words):
    text = plan_model[1].to_json()
    d = json.loads(text)
    if how == "truncated":
        path = _write(tmp_path, "p.json", text[: len(text) // 2])
    elif how == "empty":
        path = _write(tmp_path, "p.json", "")
    elif how == "not a plan":
        path = _write(tmp_path, "p.json", json.dumps({"model": "x"}))
    elif how == "a list":
        path = _write(tmp_path, "p.json", "[1, 2]")
    elif how == "missing keys":
        path = _write(tmp_path, "p.json", json.dumps({k: v for k, v in d.items() if k not in ("assignment", "edges")}))
    elif how == "wrong type":
        path = _write(tmp_path, "p.json", json.dumps({**d, "stages": {}}))
    elif how == "stage out of range":
        node = next(iter(d["assignment"]))
        path = _write(tmp_path, "p.json", json.dumps({**d, "assignment": {**d["assignment"], node: 5}}))
    elif how == "bad stage entry":
        stages = [dict(d["stages"][0]), *d["stages"][1:]]
        del stages[0]["cost"]
        path = _write(tmp_path, "p.json", json.dumps({**d, "stages": stages}))
    elif how == "directory":
        path = str(tmp_path)
    else:
        path = str(tmp_path / "nope.json")
    with pytest.raises(err) as info:
        Plan.load(path)
    e = info.value
    assert isinstance(e, PlanError) and isinstance(e, FxpipeError) and isinstance(e, builtin)
    assert repr(path) in str(e) and e.path == path
    for word in words:
        assert word in str(e), str(e)
    # the same through fxpipe.pipeline(..., plan=path)
    model = plan_model[0]
    with pytest.raises(err, match="plan"):
        fxpipe.pipeline(model, torch.randn(4, 4), 2, plan=path)


def test_plan_path_of_wrong_type(plan_model):
    with pytest.raises(PlanPathError) as info:
        Plan.load({"format": "fxpipe.plan._value/1"})
    assert isinstance(info.value, TypeError) and isinstance(info.value, PlanError)
    assert "str or os.PathLike" in str(info.value) and "got dict" in str(info.value)
    assert "Plan.from_json(json.dumps(d))" in str(info.value)
    with pytest.raises(PlanPathError, match="got dict"):
        fxpipe.pipeline(plan_model[0], torch.randn(4, 4), 2, plan={})
    with pytest.raises(PlanPathError, match="plan.save\\(path\\): path must be a str"):
        plan_model[1].save(3)


def test_plan_save_errors_name_the_file(tmp_path, plan_model):
    plan = plan_model[1]
    target = str(tmp_path / "no_dir" / "plan.json")
    with pytest.raises(PlanNotFoundError) as info:
        plan.save(target)
    assert repr(target) in str(info.value) and "existing, writable directory" in str(info.value)
    with pytest.raises(PlanFileError, match="is a directory"):
        plan.save(tmp_path)


def test_from_json_text_errors():
    with pytest.raises(PlanError, match="plan JSON is not valid JSON.*plan.to_json"):
        Plan.from_json('{"format": ')
    with pytest.raises(PlanPathError, match="Plan.load"):
        Plan.from_json({"format": "fxpipe.plan._value/1"})


def test_plan_that_does_not_fit_the_model(tmp_path, plan_model):
    model, plan = plan_model
    path = str(tmp_path / "plan.json")
    plan.save(path)
    with pytest.raises(PlanModelError) as info:
        fxpipe.pipeline(model, torch.randn(4, 4), 3, plan=path)
    e = info.value
    assert isinstance(e, PlanError) and isinstance(e, ValueError) and e.path == path
    assert repr(path) in str(e) and "has 2 stages but n_stages=3" in str(e) and "pass n_stages=2" in str(e)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(PlanModelError, match="does not match this model's graph.*make a new plan") as info:
        fxpipe.pipeline(other, torch.randn(4, 4), 2, plan=plan)
    assert info.value.path is None and "the plan does not match" in str(info.value)


# -- bad arguments: typed, still the builtin raised before, naming the argument ---------------
SEQ = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
ARG_CASES = [
    # (keyword arguments, error, builtin, argument, words)
    ({"n_stages": 0}, StagesError, ValueError, "n_stages", ["n_stages must be a positive integer", "n_stages=0"]),
    ({"n_stages": 2.5}, StagesError, ValueError, "n_stages", ["n_stages=2.5"]),
    ({"n_stages": 99, "devices": ["cpu"] * 99}, StagesError, ValueError, "n_stages",
     ["n_stages=99", "5 partitionable nodes", "use 1 <= n_stages <= 5"]),
    ({"checkpoint": "sometimes"}, ArgumentError, ValueError, "checkpoint",
     ["checkpoint must be one of 'always', 'except_last', 'never'", "checkpoint='sometimes'"]),
    ({"balance_by": "flops"}, ArgumentError, ValueError, "balance_by",
     ["balance_by must be one of", "balance_by='flops'"]),
    ({"chunks": 0}, ChunksError, ValueError, "", ["chunks=0"]),
    ({"devices": ["cpu"]}, DevicesError, IndexError, "",
     ["too few devices", "devices: 1 given, n_stages: 2", "one device per stage", "n_stages=1 or fewer"]),
    ({"split_points": ["nope"]}, SplitPointsError, ValueError, "split_points",
     ["split point 'nope' (in split_points) names no module", "such as: 0, 1"]),
    ({"split_points": "2"}, SplitPointsError, ValueError, "split_points", ["list of qualified module names"]),
    ({"split_points": ["2", "4"]}, SplitPointsError, ValueError, "split_points",
     ["split_points has 2 names but n_stages=2 needs 1", "n_stages=3"]),
    ({"n_stages": 3, "devices": ["cpu"] * 3, "split_points": ["4", "2"]}, SplitPointsError, ValueError,
     "split_points", ["split_points ('4' at node", "strictly increasing"]),
    ({"split_points": ["2"], "plan": "plan.json"}, SplitPointsError, ValueError, "split_points",
     ["plan= and split_points= were both given", "pass one of them"]),
]


@pytest.mark.parametrize("kw, err, builtin, argument, words", ARG_CASES,
                         ids=[" ".join(f"{k}={v!r}"[:24] for k, v in c[0].items()) for c in ARG_CASES])
def test_bad_arguments_are_typed(kw, err, builtin, argument, words):
    build = {"n_stages": 2, "balance_by": "params", **kw}
    with pytest.raises(err) as info:
        fxpipe.pipeline(SEQ, torch.randn(4, 4), **build)
    e = info.value
    assert isinstance(e, FxpipeError) and isinstance(e, builtin), type(e).__mro__
    if argument:
        assert e.argument == argument
    for word in words:
        assert word in str(e), str(e)


def test_plan_and_errors_import_no_torch():
    here = os.path.join(os.path.dirname(__file__), os.pardir, "fxpipe")
    for name in ("plan/_value.py", "errors.py", "plan/_partition.py", "plan/__init__.py", "capture/_node_kinds.py"):
        tree = ast.parse(open(os.path.join(here, name), encoding="utf-8").read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, name


# -- item 13: the CLI and factories that exit ------------------------------------------------
EXITING = textwrap.dedent('''
    import sys
    import torch
    from torch import nn


    class Quits(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            sys.exit(3)


    def code5():
        sys.exit(5)


    def bare_exit():
        sys.exit()


    def message():
        raise SystemExit("bad config\\nsee docs")


    def interrupted():
        raise KeyboardInterrupt


    def quits():
        return Quits(), torch.randn(2, 4)


    def ok():
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), torch.randn(2, 4)
''')


@pytest.fixture(scope="module")
def exiting_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_exit") / "exiting_model.py"
    path.write_text(EXITING)
    return str(path)


def _one_line(capsys, argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("factory, words", [
    ("code5", ["sys.exit(5)", "exit code 5"]),
    ("bare_exit", ["sys.exit()", "exit code 0"]),
    ("message", ["sys.exit('bad config see docs')", "exit code 1"]),
])
def test_factory_that_exits_is_one_line_exit_2(capsys, exiting_file, factory, words):
    line = _one_line(capsys, ["plan", f"{exiting_file}:{factory}", "-n", 2])
    assert f"factory {exiting_file}:{factory} exited with" in line
    assert "return the model" in line
    for word in words:
        assert word in line, line


def test_factory_interrupt_still_exits_130(capsys, exiting_file):
    assert main(["plan", f"{exiting_file}:interrupted", "-n", "2"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_model_file_that_exits_at_import(capsys, tmp_path):
    path = tmp_path / "script_model.py"
    path.write_text("import sys\nsys.exit(4)\n")
    line = _one_line(capsys, ["plan", f"{path}:factory", "-n", 2])
    assert f"importing {path} exited with sys.exit(4)" in line and "__name__ == '__main__'" in line


def test_model_that_exits_while_traced(capsys, exiting_file):
    line = _one_line(capsys, ["plan", f"{exiting_file}:quits", "-n", 2, "--balance-by", "params"])
    assert "sys.exit(3) (exit code 3)" in line and "model's code" in line
    rc = main(["plan", f"{exiting_file}:quits", "-n", "2", "--balance-by", "params", "--debug"])
    assert rc == 2 and "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("where, words", [
    ("{dir}/missing_dir/plan.json", ["does not exist", "missing_dir"]),
    ("{dir}", ["is a directory", "plan.json"]),
])
def test_plan_save_path_checked_first(capsys, exiting_file, where, words):
    where = where.format(dir=os.path.dirname(exiting_file))
    # the factory would exit: the bad --save path is reported before the model is loaded
    line = _one_line(capsys, ["plan", f"{exiting_file}:code5", "-n", 2, "--save", where])
    assert f"--save {where}" in line
    for word in words:
        assert word in line, line


def test_deep_copied_pipeline_still_names_the_argument(pipes):
    import copy

    clone = copy.deepcopy(pipes["bare"])  # fx's deepcopy forgets the model's class name
    with pytest.raises(InputMismatchError, match="mask=None is passed but the sample did not pass mask"):
        clone(X, mask=None)
    with pytest.raises(InputMismatchError, match="forward has no parameter 'foo'"):
        clone(X, foo=1)


# -- issue #18: a sample that does not fit the forward signature ------------------------------
@pytest.mark.parametrize("args, kwargs, words", [
    ((torch.randn(4, 4), torch.randn(4, 4)), {}, ["Net.forward takes 1 to 6 positional inputs (x, y=None",
                                                  "was given 7 positional inputs"]),
    ((torch.randn(4, 4),), {"labels": torch.randn(4)}, ["keyword labels", "unexpected keyword argument 'labels'"]),
    ((), {}, ["was given 0 positional inputs", "missing a required argument: 'x'"]),
], ids=["too many", "unknown keyword", "none"])
def test_sample_that_does_not_fit_forward_says_what_it_takes(args, kwargs, words):
    """Two inputs for a one-input model were refused by the capture with advice about control
    flow ('move it into a submodule'): it says how many inputs the model takes instead."""
    if len(args) == 2:
        args = args * 3 + args[:1]  # 7 inputs: one more than Net takes
    with pytest.raises(ArgumentError) as info:
        fxpipe.pipeline(Net(), args, 2, sample_kwargs=kwargs, devices=["cpu"] * 2, balance_by="params")
    e = info.value
    assert e.argument == "sample" and isinstance(e, ValueError)
    for word in ["the sample does not fit the model", *words, "sample_kwargs="]:
        assert word in str(e), str(e)
    assert "control flow" not in str(e) and "submodule" not in str(e)


def test_forward_pre_hook_is_refused_for_itself_not_for_the_sample():
    """A forward pre-hook can change what forward receives, so the signature does not decide;
    hooks on the model itself are refused with their own message (fxpipe.capture._hooks)."""
    from fxpipe.errors import TraceError

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model.register_forward_pre_hook(lambda m, args: (args[0] + args[1],))
    x = torch.randn(4, 4)
    with pytest.raises(TraceError, match="itself has forward or backward hooks"):
        fxpipe.pipeline(model, (x, x), 2, devices=["cpu"] * 2, balance_by="params")


class _LabelledLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.b(self.a(x)), labels)


def test_a_sample_the_model_itself_rejects_leads_with_the_models_own_error():
    """Labels of the wrong shape: the capture's complaint (untraceable code, a bare ValueError
    from inside its run) used to lead; now the model's own error does, as a TraceError."""
    with pytest.raises(fxpipe.TraceError, match=r"the model itself fails on the sample: ValueError: Expected "
                                                r"input batch_size \(8\) to match target batch_size \(5\)\. "):
        fxpipe.pipeline(_LabelledLoss(), (torch.randn(8, 4), torch.randint(0, 3, (5,))), 2, chunks=2,
                        devices=["cpu"] * 2, output_merge="mean", progress=False)
