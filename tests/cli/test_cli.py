"""The ``fxpipe`` command line: every subcommand, and the one-line error policy.

The end-to-end checks run ``python -m fxpipe`` in a subprocess; the many error cases call
``fxpipe.cli._main.main`` in-process (same code path, no interpreter start-up each time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from fxpipe.cli._main import main, parse_input, UsageError

HAVE_DOT = shutil.which("dot") is not None

MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
            self.c = nn.Linear(16, 16)
            self.d = nn.Linear(32, 4)

        def forward(self, x):
            h = F.relu(self.a(x))
            return self.d(torch.cat([self.c(self.b(h)), h], 1))


    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 8)
            self.fc1 = nn.Linear(8, 8)
            self.fc2 = nn.Linear(8, 2)

        def forward(self, ids):
            return self.fc2(torch.relu(self.fc1(self.emb(ids))))


    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.l(x)
            return x


    def factory():
        return Tiny(), torch.randn(8, 8)


    class BatchMean(nn.Module):
        """Normalises over the batch: micro-batches are not the batch (the library refuses it)."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.a(x)
            return self.b(h - h.mean(0, keepdim=True))


    def batch_mean():
        torch.manual_seed(0)
        return BatchMean(), torch.randn(8, 8)


    def bare():
        return Tiny()


    def tokens():
        return Tokens()


    def boom():
        raise RuntimeError("factory exploded")


    def untraceable():
        return DataDependent(), torch.randn(2, 4)
''')


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny_model.py"
    path.write_text(MODEL)
    return str(path)


def fx(*args, env=None, timeout=240):
    """Runs ``python -m fxpipe ARGS`` (stderr is a pipe: no progress lines)."""
    return subprocess.run([sys.executable, "-m", "fxpipe", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line_error(res_or_err, code=2):
    rc, err = res_or_err
    assert rc == code
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def run_main(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- subcommands, end to end -------------------------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "render"])
def test_the_command_line_refuses_what_the_library_refuses(capsys, model_file, tmp_path, command):
    """plan and render build through fxpipe.build like fxpipe.pipeline: a model that mixes the
    samples of its batch is refused with the library's own MicroBatchError message."""
    import importlib.util

    import fxpipe
    from fxpipe.errors import MicroBatchError

    spec = importlib.util.spec_from_file_location("cli_tiny_model", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, x = module.batch_mean()
    with pytest.raises(MicroBatchError) as info:
        fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False)
    extra = ["-o", tmp_path / "g.svg"] if command == "render" else []
    rc, out, err = run_main(capsys, command, f"{model_file}:batch_mean", "--stages", 2, "--chunks", 2,
                            "--balance-by", "params", *extra)
    assert rc != 0 and out == ""
    assert str(info.value).splitlines()[0] in err


def test_plan_json_subprocess(model_file, tmp_path):
    saved = tmp_path / "plan.json"
    res = fx("plan", f"{model_file}:factory", "--stages", 3, "--balance-by", "params", "--json", "--save", saved)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # quiet when piped
    plan = json.loads(res.stdout)
    assert plan["n_stages"] == 3 and len(plan["stages"]) == 3
    assert json.loads(saved.read_text())["assignment"] == plan["assignment"]


@pytest.mark.skipif(not HAVE_DOT, reason="graphviz dot binary not installed")
def test_render_svg_subprocess(model_file, tmp_path):
    out = tmp_path / "graph.svg"
    res = fx("render", f"{model_file}:factory", "--stages", 3, "--balance-by", "params", "-o", out)
    assert res.returncode == 0, res.stderr
    root = ET.parse(out).getroot()
    clusters = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "cluster"]
    assert len(clusters) == 3
    assert {g.get("id") for g in clusters} == {"clust1", "clust2", "clust3"}


def test_timeline_subprocess(model_file, tmp_path):
    out = tmp_path / "trace.json"
    n, chunks, steps = 3, 2, 2
    res = fx("timeline", f"{model_file}:factory", "--stages", n, "--chunks", chunks, "--steps", steps,
             "--balance-by", "params", "-o", out)
    assert res.returncode == 0, res.stderr
    trace = json.loads(out.read_text())
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    for e in xs:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(e)
    forwards = [e for e in xs if e.get("cat") == "forward"]
    assert len(forwards) == n * chunks * steps
    for step in (1, 2):
        assert len([e for e in forwards if e["args"]["step"] == step]) == n * chunks
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"stage {k} (cpu)" for k in range(n)} <= lanes
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_env_subprocess():
    res = fx("env")
    assert res.returncode == 0, res.stderr
    for word in ("fxpipe", "torch", "python", "devices", "graphviz dot", "matplotlib"):
        assert word in res.stdout
    if HAVE_DOT:
        assert "not found" not in res.stdout.split("graphviz dot", 1)[1].splitlines()[0]


def test_demo_subprocess():
    res = fx("demo", timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout and "FAIL" not in res.stdout
    assert "max abs difference" in res.stdout
    assert "Plan: 4 stages" in res.stdout
    assert "# pop" in res.stdout  # the code of the stage that pops a portal


def test_error_subprocess_one_line_and_debug(model_file):
    line = one_line_error((lambda r: (r.returncode, r.stderr))(fx("plan", f"{model_file}:boom", "--stages", 2)))
    assert "factory exploded" in line
    res = fx("plan", f"{model_file}:boom", "--stages", 2, "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr and "factory exploded" in res.stderr


# -- subcommands, in-process -------------------------------------------------------------------
def test_plan_table_and_module_spec(capsys, model_file):
    rc, out, err = run_main(capsys, "plan", f"{model_file}:factory", "-n", 2, "--balance-by", "params")
    assert rc == 0, err
    assert out.startswith("Plan: 2 stages, balanced by params") and "portals" in out
    # package.module:factory form and --input overriding the factory's sample
    rc, out, err = run_main(capsys, "plan", "fxpipe.cli._demo:make_unet", "-n", 2, "--balance-by", "params",
                            "--input", "2,3,16,16")
    assert rc == 0, err
    assert "Plan: 2 stages" in out


def test_plan_time_says_what_was_measured_and_no_progress(capsys, model_file):
    """A 'time' plan profiled on one micro-batch counts the costs it measured and reused;
    --no-progress is accepted by every model subcommand and turns the status line off."""
    from fxpipe.progress import enabled as progress_enabled

    rc, out, err = run_main(capsys, "plan", f"{model_file}:factory", "-n", 2, "--chunks", 2, "--no-progress")
    assert rc == 0, err
    assert "nodes timed on one micro-batch (of 2)" in out and "reused" in out
    assert not progress_enabled()
    rc, out, err = run_main(capsys, "plan", f"{model_file}:factory", "-n", 2, "--balance-by", "params", "--json")
    assert rc == 0 and progress_enabled()  # set per call
    assert json.loads(out)["meta"]["costs"] == {"measured": 0, "reused": 0, "reused_from": {}}


def test_plan_int_input_and_leaf(capsys, model_file):
    rc, out, err = run_main(capsys, "plan", f"{model_file}:tokens", "-n", 2, "--input", "4x6:int64",
                            "--balance-by", "params", "--leaf", "fc1", "--json")
    assert rc == 0, err
    assert json.loads(out)["n_stages"] == 2


def test_code_all_and_one_stage(capsys, model_file):
    rc, out, err = run_main(capsys, "code", f"{model_file}:factory", "-n", 3, "--balance-by", "params")
    assert rc == 0, err
    assert out.count("# ---- stage") == 3 and "def forward" in out
    rc, out, _ = run_main(capsys, "code", f"{model_file}:factory", "-n", 3, "--balance-by", "params", "--stage", 2)
    assert rc == 0 and out.count("# ---- stage 2 ----") == 1 and "# pop" in out


def test_render_dot_fallback_without_graphviz(capsys, model_file, tmp_path, monkeypatch):
    monkeypatch.setattr("fxpipe.cli.viz._render.shutil.which", lambda name: None)
    out = tmp_path / "g.png"
    rc, stdout, err = run_main(capsys, "render", f"{model_file}:factory", "-n", 3, "--balance-by", "params",
                               "--depth", 1, "-o", out)
    assert rc == 0
    assert not out.exists() and (tmp_path / "g.dot").read_text().startswith("digraph")
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    assert "g.dot" in stdout


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["plan", "{dir}/missing.py:factory", "-n", "2"], "no such file"),
    (["plan", "{file}:nope", "-n", "2"], "no factory 'nope'"),
    (["plan", "{file}:factory", "-n", "2", "--input", "8xx8"], "malformed --input"),
    (["plan", "{file}:factory", "-n", "2", "--input", "8x8:float99"], "unknown dtype"),
    (["plan", "{file}:boom", "-n", "2"], "factory exploded"),
    (["plan", "{file}:untraceable", "-n", "2"], "could not capture"),
    (["plan", "{file}:factory", "-n", "0"], "--stages"),
    (["plan", "{file}:factory", "-n", "two"], "--stages"),
    (["plan", "{file}:factory", "-n", "99", "--balance-by", "params"], "n_stages"),
    (["plan", "{file}:bare", "-n", "2"], "--input"),
    (["plan", "no_such_pkg_xyz.mod:f", "-n", "2"], "no module named"),
    (["plan", "{file}", "-n", "2"], "path/to/file.py:factory"),
    (["plan", "{file}:factory", "-n", "2", "--input", "8x9", "--balance-by", "params"], "RuntimeError"),
    (["plan", "{file}:factory", "-n", "2", "--split-at", "nope", "--balance-by", "params"], "split point"),
    (["code", "{file}:factory", "-n", "2", "--stage", "7", "--balance-by", "params"], "out of range"),
    (["render", "{file}:factory", "-n", "2", "-o", "{dir}/g.txt"], "unknown format"),
    (["timeline", "{file}:factory", "-n", "2", "--device", "tpu"], "--device"),
    (["plan"], "MODEL"),
])
def test_errors_are_one_line_exit_2(capsys, model_file, args, needle):
    args = [a.format(file=model_file, dir=os.path.dirname(model_file)) for a in args]
    rc = main(args)
    out, err = capsys.readouterr()
    line = one_line_error((rc, err))
    assert needle.lower() in line.lower(), line


def test_too_many_inputs_say_how_many_the_model_takes(capsys, model_file):
    """Two --input for a one-input model: not the capture's advice about control flow."""
    rc = main(["plan", f"{model_file}:factory", "-n", "2", "--input", "8x8", "--input", "8x8"])
    line = one_line_error((rc, capsys.readouterr().err))
    assert "Tiny.forward takes 1 positional input (x), but 2 --input were given" in line, line
    assert "one --input per positional input" in line and "control flow" not in line


def test_debug_shows_traceback(capsys, model_file):
    rc = main(["plan", f"{model_file}:untraceable", "-n", "2", "--debug"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "TraceError" in err


def test_parse_input():
    assert parse_input("8x3x32x32") == ((8, 3, 32, 32), "float32")
    assert parse_input("8,3") == ((8, 3), "float32")
    assert parse_input("16x128:int64") == ((16, 128), "int64")
    assert parse_input("4:half") == ((4,), "float16")
    for bad in ("", "8x", "axb", "8x0", "8:nope", "8:Tensor"):
        with pytest.raises(UsageError):
            parse_input(bad)


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


def test_timeline_without_matplotlib_writes_the_trace_only(model_file, tmp_path, capsys, monkeypatch):
    """matplotlib is a dev extra: without it the JSON trace is still written and the PNG is named as skipped."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "trace.json"
    rc, stdout, err = run_main(capsys, "timeline", f"{model_file}:factory", "--stages", 2, "--chunks", 2,
                               "--steps", 1, "--balance-by", "params", "-o", out)
    assert rc == 0, err
    assert json.loads(out.read_text())["traceEvents"]
    assert not (tmp_path / "trace.png").exists()
    assert f"not written: {tmp_path / 'trace.png'} (matplotlib is not installed: pip install 'fxpipe[plot]')" in stdout
