"""benchmarks/one_gpu.py (issue 21's one-device table) on the CPU: its rows run and pass their
exactness check, and that check fails a wrong row (so a GPU run cannot time one silently)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _one_gpu_rows as R  # noqa: E402
import one_gpu  # noqa: E402


def test_quick_rows_run_and_are_exact(tmp_path, capsys):
    out = tmp_path / "one_gpu.json"
    one_gpu.main(["--quick", "--model", "gpt2", "--rows", "eager", "accum", "pipe:4:always", "pipe:4:never:ro",
                  "--steps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["models"][0]["rows"]
    assert [r["key"] for r in rows] == ["eager", "accum", "pipe:4:always", "pipe:4:never:ro"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["check"]["exact"] and r["check"]["worst_over_allowed"] <= 1.0
        assert r["median_s"] > 0 and r["peak_bytes"] > 0
    printed = capsys.readouterr().out
    assert "| fxpipe chunks=4 `'always'` |" in printed and "0 row(s) not ok" in printed


@pytest.mark.parametrize("autocast", [False, True])
def test_check_fails_a_wrong_row(autocast):
    spec = R.model_spec("gpt2", quick=True)
    torch.manual_seed(0)
    model = spec.make().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)
    targets = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)

    def run(key, batch=spec.batch):
        runner = R.build(key, model, ids, 4, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, logits = runner.step(ids[:batch], targets[:batch], keep=True)
        return loss, logits, runner.grads()

    ref, accum = run("eager"), run("accum")
    assert R.check(accum, ref, autocast, False)["exact"]
    doubled = (accum[0], accum[1], [(n, g * 2) for n, g in accum[2]])
    assert not R.check(doubled, ref, autocast, False)["exact"]
    lost = run("accum", batch=spec.batch * 3 // 4)  # one micro-batch of four lost, the rest weighted as if whole
    lost = (accum[0], accum[1], [(n, g * 3 / 4) for n, g in lost[2]])
    assert not R.check(lost, ref, autocast, False)["exact"]
    missing = (accum[0], accum[1], [(n, None if i == 3 else g) for i, (n, g) in enumerate(accum[2])])
    assert R.check(missing, ref, autocast, False)["worst_over_allowed"] == float("inf")
