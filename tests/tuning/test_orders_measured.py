"""The action order fxpipe.tune simulates is the order the runs show, device by device.

Each schedule runs one training step of a small MLP with its spans recorded
(``fxpipe.distributed.trace.record`` on gloo ranks; the single-process runtime's
``Recorder`` for ``'gpipe'``), and each device's (kind, stage, micro-batch) sequence, in the
order the actions started, must equal what :mod:`fxpipe.tuning._orders` predicts. Orders
only: nothing here is timed. World size 1 with two stages per rank runs in this process
(the interleaved and V orders); two ranks are spawned (every schedule, 1F1B's last rank
included: torch 2.13's ``Schedule1F1B.pipeline_order`` draws it differently from what its
step runs, and the run settles which one the tuner must simulate).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime._timeline import Recorder
from fxpipe.tuning._orders import Action, measured_orders, single_process_1f1b, single_process_order, torch_orders

#: (schedule, stages per rank, chunks, checkpoint) on one rank, in this process
ONE_RANK = [("interleaved1f1b", 2, 4, "never"), ("interleaved1f1b", 2, 3, "always"),
            ("zbv", 2, 4, "never"), ("zbv", 2, 2, "except_last"), ("interleavedzb", 2, 4, "always")]
#: on two spawned ranks
TWO_RANKS = [("gpipe", 1, 4, "never"), ("gpipe", 1, 1, "always"), ("1f1b", 1, 4, "never"),
             ("1f1b", 1, 2, "never"), ("1f1b", 1, 5, "except_last"), ("1f1b", 1, 8, "always"),
             ("interleaved1f1b", 2, 4, "never"), ("interleaved1f1b", 2, 8, "except_last"),
             ("interleavedzb", 2, 4, "never"), ("zbv", 2, 4, "always"), ("zbv", 2, 2, "never"),
             ("zbv", 2, 5, "except_last")]


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(16, 4)), torch.randn(120, 16), torch.randn(120, 4)


def traced_orders(fpd: Any, cases: list) -> dict:
    """Each case's measured orders on this rank's group: one warm-up step, one traced."""
    from fxpipe.distributed.trace import record

    found = {}
    for schedule, per_rank, chunks, mode in cases:
        model, x, y = mlp()
        pipe = fpd.pipeline(model, x, chunks=chunks, loss_fn=F.mse_loss, schedule=schedule, stages_per_rank=per_rank,
                            checkpoint=mode, timeout=60, progress=False)
        try:
            pipe.step(x, target=y)
            with record(pipe) as trace:
                pipe.step(x, target=y)
        finally:
            pipe.close()
        found[(schedule, per_rank, chunks, mode)] = measured_orders(trace.spans)
    return found


def _worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    found = traced_orders(fpd, cases)
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _fmt(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def check(found: dict, world: int) -> None:
    for (schedule, _, chunks, mode), measured in found.items():
        predicted = torch_orders(schedule, world, chunks)
        assert sorted(measured) == list(range(world)), (schedule, chunks, mode, sorted(measured))
        for rank in range(world):
            assert _fmt(measured[rank]) == _fmt(predicted[rank]), (
                f"{schedule} chunks={chunks} checkpoint={mode} rank {rank}\n"
                f" measured:  {_fmt(measured[rank])}\n predicted: {_fmt(predicted[rank])}")


def test_single_process_pipeline_runs_the_simulated_order() -> None:
    """fxpipe.pipeline on CPU devices: forwards in clock cycles, backwards in their reverse
    (the order each task began; a recomputation inside its backward is not an action)."""
    model, x, _ = mlp()
    for n, chunks, mode in [(4, 4, "never"), (2, 4, "always"), (3, 2, "except_last"), (4, 1, "never"),
                            (3, 5, "always")]:
        pipe = fxpipe.pipeline(model, x, n, chunks=chunks, devices=["cpu"] * n, checkpoint=mode, progress=False)
        pipe(x).sum().backward()  # warm-up
        with Recorder() as rec:
            pipe(x).sum().backward()
        measured = measured_orders(rec.spans)
        assert list(measured) == ["cpu"]
        assert _fmt(measured["cpu"]) == _fmt(single_process_order(n, chunks)), (n, chunks, mode)


def test_single_process_1f1b_step_runs_the_simulated_order() -> None:
    """``fxpipe.pipeline(schedule='1f1b')``'s step: forward ticks, each micro-batch's backward
    through every stage after the tick it left the last one in (what tune simulates)."""
    model, x, _ = mlp()
    for n, chunks, mode in [(4, 4, "never"), (2, 4, "always"), (3, 2, "except_last"), (3, 5, "always")]:
        pipe = fxpipe.pipeline(model, x, n, chunks=chunks, devices=["cpu"] * n, checkpoint=mode, progress=False,
                               schedule="1f1b")
        pipe.step(x, loss_fn=lambda out: out.sum())  # warm-up
        with Recorder() as rec:
            pipe.step(x, loss_fn=lambda out: out.sum())
        measured = measured_orders(rec.spans)
        assert list(measured) == ["cpu"]
        assert _fmt(measured["cpu"]) == _fmt(single_process_1f1b(n, chunks)[0]), (n, chunks, mode)


def test_one_rank_interleaved_and_v_orders_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.distributed._launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        found = traced_orders(fpd, ONE_RANK)
    finally:
        dist.destroy_process_group()
    check(found, 1)


@pytest.mark.slow
def test_two_ranks_run_the_simulated_orders(tmp_path: Path) -> None:
    from dist_harness import run_ranks

    results = run_ranks(_worker, 2, (TWO_RANKS,), tmp_path)
    assert results[0].keys() == results[1].keys()
    for key in results[0]:  # the trace is gathered: every rank holds every rank's spans
        assert results[0][key] == results[1][key], key
    check(results[0], 2)


def test_measured_orders_reads_both_recorders_spans() -> None:
    """Hand-made spans: sorted by start, a backward with a weight pass is 'I', other kinds
    and other steps left out."""
    from fxpipe.distributed.trace import Span

    spans = [Span("backward", 0, 1, 0, 0, 2.0, 3.0), Span("forward", 0, 1, 0, 0, 1.0, 2.0),
             Span("weight", 0, 1, 0, 0, 3.0, 4.0), Span("recv", 0, 1, 0, 0, 0.5, 1.0, "forward"),
             Span("forward", 1, 0, 0, 0, 0.0, 0.5), Span("step", 0, -1, -1, 0, 0.0, 5.0),
             Span("forward", 0, 1, 0, 1, 6.0, 7.0), Span("loss", 0, 1, 0, 0, 2.0, 2.1)]
    assert measured_orders(spans, step=0) == {1: [Action("F", 0, 0)], 0: [Action("F", 1, 0), Action("I", 1, 0),
                                                                           Action("W", 1, 0)]}
    from fxpipe.runtime._timeline import Span as LocalSpan

    local = [LocalSpan("backward", 1, 0, "cpu", 3.0, 4.0), LocalSpan("recompute", 1, 0, "cpu", 3.1, 3.5),
             LocalSpan("forward", 0, 0, "cpu", 1.0, 2.0), LocalSpan("copy", 0, 0, "cpu", 2.0, 2.1)]
    assert measured_orders(local) == {"cpu": [Action("F", 0, 0), Action("B", 1, 0)]}
