"""``fxpipe demo --nproc`` and ``fxpipe timeline --nproc``: torchrun ranks with gloo on 127.0.0.1.

End to end in subprocesses (``python -m fxpipe``), each bounded: the command's own
``--timeout`` kills its ranks, and ``subprocess.run``'s timeout bounds the command. Faults are
injected from the test side only: a ``sitecustomize.py`` put first on the ranks' PYTHONPATH
patches the library in one rank's process (a perturbed gradient, a stuck rank); the product
code has no switch for it. :func:`bubble_fractions` is also checked on hand-made spans.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fxpipe.cli._main import main
from fxpipe.distributed.trace import Span, bubble_fractions

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "zoo.py"
COMMAND_SECONDS = 240  # the bound on one command; its --timeout is shorter


def fx(*args: object, env: dict | None = None, timeout: float = COMMAND_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxpipe", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _with_sitecustomize(tmp: Path, code: str) -> dict:
    """An environment whose processes import ``code`` at start-up (the ranks and the parent)."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    return env


# -- demo ----------------------------------------------------------------------------------------
def test_demo_on_two_ranks_matches_eager() -> None:
    res = fx("demo", "--nproc", 2, "--timeout", 150)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "Plan: 2 stages" in out and "2 stages on 2 ranks" in out
    assert "rank 0: stage 0" in out and "rank 1: stage 1" in out
    for what in ("losses:", "gradients:", "parameters after 3 SGD steps:"):
        line = next(ln for ln in out.splitlines() if ln.startswith(what))
        assert "max abs difference vs eager" in line and line.endswith("ok"), line
    assert len(re.findall(r"^step \d: loss ", out, re.M)) == 3
    assert out.rstrip().endswith("PASS") and "FAIL" not in out


@pytest.mark.slow
def test_demo_fails_when_a_rank_gets_a_wrong_gradient(tmp_path: Path) -> None:
    """Rank 1's pipeline adds 1e-3 to one gradient after each step: the comparison must see it."""
    env = _with_sitecustomize(tmp_path, """
        import os
        if os.environ.get("RANK") == "1" and "LOCAL_RANK" in os.environ:
            import fxpipe.distributed._pipe as _pipe
            _step = _pipe.DistributedPipeline.step

            def step(self, *args, **kwargs):
                loss = _step(self, *args, **kwargs)
                next(iter(self.parameters())).grad.add_(1e-3)
                return loss

            _pipe.DistributedPipeline.step = step
    """)
    res = fx("demo", "--nproc", 2, "--timeout", 150, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    grads = next(ln for ln in res.stdout.splitlines() if ln.startswith("gradients:"))
    assert grads.endswith("MISMATCH") and "rank 1" in grads, grads
    assert res.stdout.rstrip().endswith("FAIL")


@pytest.mark.slow
def test_demo_kills_its_ranks_at_the_timeout(tmp_path: Path) -> None:
    """Rank 1 hangs in its first step: the command ends after --timeout with a clear message,
    and no rank is left running."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _with_sitecustomize(tmp_path, f"""
        import os
        if "LOCAL_RANK" in os.environ:
            open(os.path.join({str(pids)!r}, os.environ["RANK"]), "w").write(str(os.getpid()))
            if os.environ["RANK"] == "1":
                import time
                import fxpipe.distributed._pipe as _pipe

                def step(self, *args, **kwargs):
                    time.sleep(3600)

                _pipe.DistributedPipeline.step = step
    """)
    start = time.monotonic()
    res = fx("demo", "--nproc", 2, "--timeout", 40, env=env)
    took = time.monotonic() - start
    assert res.returncode == 1, res.stdout + res.stderr
    assert "did not finish within --timeout 40 s and were killed" in res.stderr, res.stderr
    assert took < 40 + 30, took
    for f in pids.iterdir():
        status = Path(f"/proc/{f.read_text()}/status")
        assert not status.exists() or "\nState:\tZ" in status.read_text(), f"rank {f.name} is still running"


@pytest.mark.slow
def test_a_rank_error_is_one_line_per_rank() -> None:
    res = fx("demo", "--nproc", 2, "--schedule", "1f1b", "--chunks", 1, "--timeout", 100)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    # rank 1 raises the same, or fails on its closed connection to rank 0 first
    assert re.match(r"fxpipe demo: error: ranks? 0(, 1)?: schedule '1f1b' needs chunks >= the number of stages",
                    lines[0]), lines[0]


@pytest.mark.parametrize("args, word", [
    (["demo", "--nproc", 2, "--stages", 3], "multiple of 2"),
    (["demo", "--nproc", 2, "--schedule", "nope"], "--schedule must be one of"),
    (["demo", "--schedule", "1f1b"], "add --nproc"),
    (["demo", "--steps", 2], "add --nproc"),
    (["timeline", f"{ZOO}:unet", "-n", 2, "--timeout", 5], "add --nproc"),
    (["timeline", f"{ZOO}:unet", "-n", 2, "--nproc", 2, "--device", "cuda"], "runs on the CPU"),
    (["timeline", "hf:gpt2", "-n", 2, "--nproc", 2], "meta device"),
    (["demo", "--nproc", 2, "--timeout", "inf"], "--timeout must be a positive number"),
])
def test_nproc_usage_errors_are_one_line_before_any_process(capsys: pytest.CaptureFixture, args: list,
                                                             word: str) -> None:
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2 and word in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


# -- timeline ------------------------------------------------------------------------------------
def test_timeline_on_ranks_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """matplotlib is the ``plot`` extra, not a dependency: the ranks write the JSON trace and
    rank 0 prints the command that installs the extra (it is in pyproject.toml)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["plot"]] == ["matplotlib"]
    env = _with_sitecustomize(tmp_path, """
        import sys
        sys.modules["matplotlib"] = None  # import matplotlib raises ImportError
    """)
    out = tmp_path / "trace.json"
    res = fx("timeline", f"{ZOO}:unet", "--stages", 2, "--nproc", 2, "--chunks", 2, "--steps", 1,
             "--balance-by", "params", "--timeout", 150, "-o", out, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(out.read_text())["traceEvents"]
    assert not (tmp_path / "trace.png").exists()
    png = tmp_path / "trace.png"
    assert f"not written: {png} (matplotlib is not installed: pip install 'fxpipe[plot]')" in res.stdout, res.stdout


def test_timeline_on_two_ranks(tmp_path: Path) -> None:
    """One lane per rank with a forward and a backward span for every micro-batch of every
    stage and step; a rank's spans never overlap; rank 1 forwards micro-batch i only after
    rank 0 started it; the bubble fraction of each rank is in [0, 1)."""
    out = tmp_path / "trace.json"
    chunks, steps = 4, 2
    res = fx("timeline", f"{ZOO}:unet", "--stages", 2, "--nproc", 2, "--chunks", chunks, "--steps", steps,
             "--balance-by", "params", "--timeout", 150, "-o", out)
    assert res.returncode == 0, res.stdout + res.stderr
    trace = json.loads(out.read_text())
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in xs:
        assert {"ts", "dur", "pid", "tid", "name", "cat", "args"} <= set(e) and e["dur"] >= 0
    work = [e for e in xs if e["cat"] != "step"]
    assert {e["pid"] for e in work} == {0, 1} and {e["tid"] for e in work} == {1}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[0].startswith("rank 0 (stage 0)") and names[1].startswith("rank 1 (stage 1)")
    for rank in (0, 1):
        for kind in ("forward", "backward"):
            got = sorted((e["args"]["step"], e["args"]["microbatch"]) for e in work
                         if e["pid"] == rank and e["cat"] == kind)
            assert got == [(s, m) for s in range(1, steps + 1) for m in range(chunks)], (rank, kind, got)
            assert all(e["args"]["stage"] == rank for e in work if e["pid"] == rank and e["cat"] == kind)
        lane = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in work if e["pid"] == rank)
        for a, b in zip(lane, lane[1:]):
            assert b[0] >= a[1] - 1e-3, f"rank {rank}: {a[2]} and {b[2]} overlap"
        assert len([e for e in xs if e["pid"] == rank and e["cat"] == "step"]) == steps
    assert {e["cat"] for e in work} >= {"recv", "send", "loss"}
    for s in range(1, steps + 1):
        for m in range(chunks):
            f0, f1 = ([e["ts"] for e in work if e["pid"] == r and e["cat"] == "forward"
                       and (e["args"]["step"], e["args"]["microbatch"]) == (s, m)][0] for r in (0, 1))
            assert f1 > f0, (s, m)
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("bubble"))
    fractions = [float(x) / 100 for x in re.findall(r"rank \d+ ([\d.]+)%", line)]
    assert len(fractions) == 2 and all(0 <= f < 1 for f in fractions), line


def _span(kind: str, rank: int, start: float, end: float, step: int = 0) -> Span:
    return Span(kind, rank, rank, 0, step, start, end)


def test_bubble_fractions_merge_overlaps_and_clip_to_steps() -> None:
    spans = [_span("step", 0, 0, 10), _span("forward", 0, 1, 3), _span("loss", 0, 2, 4), _span("recv", 0, 4, 9),
             _span("step", 1, 1, 11), _span("backward", 1, 0, 2), _span("weight", 1, 10, 12),
             _span("step", 1, 20, 30, step=1), _span("forward", 1, 20, 30, step=1)]
    # rank 0: computes 1..4 of 10 (the receive wait is idle); rank 1: 1..2 and 10..11 of its
    # first step, all of its second
    assert bubble_fractions(spans) == pytest.approx([0.7, 8 / 20])
    with pytest.raises(ValueError, match="rank 0 has no recorded pipe.step"):
        bubble_fractions([_span("step", 1, 0, 1)])


# -- record() on spawned ranks -------------------------------------------------------------------
def _record_worker(rank: int, world: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import schedules

    import fxpipe.distributed as fpd
    from fxpipe.distributed.trace import record

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    original = (schedules._batch_p2p, schedules._wait_batch_p2p)
    results = {}
    for traced in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        pipe = fpd.pipeline(model, x, chunks=4, loss_fn=F.mse_loss, schedule="1f1b", timeout=60)
        stage = pipe.schedule._stage
        losses = [pipe.step(x, target=y).item()]  # warm-up
        if traced:
            with record(pipe) as trace:
                losses += [pipe.step(x, target=y).item() for _ in range(2)]
            results["spans"] = trace.spans
            results["stages"] = trace.stages
            try:
                with record(pipe):
                    raise KeyError("inside")
            except KeyError:
                results["raised"] = True
        else:
            losses += [pipe.step(x, target=y).item() for _ in range(2)]
        results[traced] = (losses, {n: p.grad.clone() for n, p in pipe.named_parameters()})
        results[f"restored {traced}"] = ("step" not in vars(pipe) and not {
            "forward_one_chunk", "backward_one_chunk", "get_fwd_recv_ops", "get_bwd_send_ops"} & set(vars(stage))
            and "_maybe_compute_loss" not in vars(pipe.schedule)
            and (schedules._batch_p2p, schedules._wait_batch_p2p) == original)
        pipe.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_record_changes_nothing_and_gives_every_rank_the_same_trace(tmp_path: Path) -> None:
    import torch

    from dist_harness import run_ranks

    results = run_ranks(_record_worker, 2, (), tmp_path, COMMAND_SECONDS)
    for res in results:
        plain, traced = res[False], res[True]
        assert plain[0] == traced[0]  # the same losses, bit for bit
        assert plain[1].keys() == traced[1].keys()
        for n, g in plain[1].items():
            assert torch.equal(g, traced[1][n]), n
        assert res["restored False"] and res["restored True"] and res["raised"]
    assert results[0]["spans"] == results[1]["spans"] and results[0]["stages"] == [[0], [1]]
    spans = results[0]["spans"]
    for r in (0, 1):
        for kind in ("forward", "backward"):
            assert sorted((s.step, s.microbatch) for s in spans if s.rank == r and s.kind == kind) == [
                (st, m) for st in (0, 1) for m in range(4)]
    assert all(0 <= b < 1 for b in bubble_fractions(spans))
