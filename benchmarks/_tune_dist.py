"""``benchmarks/tune.py --distributed``: fxpipe.tune's distributed predictions on gloo ranks.

The parent runs ``fxpipe.tune(model, x, devices=WORLD, schedules=(1f1b, interleaved1f1b,
zbv), optimizer='sgd')`` once (profiled costs: the model has weights), then spawns ``WORLD``
gloo ranks (one torch thread each) that build every configuration it predicted, from its
own ``kwargs`` (the same plan), with ``F.mse_loss`` against zeros, and per configuration:

* **order**: one traced step (``fxpipe.distributed.trace.record``), each rank's
  (kind, stage, micro-batch) sequence (``fxpipe.tuning._orders.measured_orders``) against
  the order the tuner simulated for it;
* **memory**: one step after a warm-up step, under ``benchmarks/_memory.py``'s CPU ``Meter``
  inside each rank (this process's allocator records, every thread, gloo's included),
  profiled from before the pipeline is built: the profiler does not see the free of a block
  allocated before it started, and a step frees what the previous one left (zero bubble's
  input gradients, the V's hand-overs). Measured: the step's peak above its own lowest point
  (what the pipeline holds all through it: parameters, ``.grad`` made before the base,
  receive buffers), against the rank's predicted activation bytes
  (``choice.activation_bytes[rank]``). The predicted static part is reported beside;
* **time**: ``steps`` more steps, each started by a barrier, outside the profiler, and
  ``steps`` more in a second pass over every configuration (rebuilt) once the first is done:
  load on these shared cores comes and goes over minutes. A configuration's time is its
  fastest step's slowest rank (a step ends when its last rank is done; other work on the
  machine only adds time), against the predicted step time; and **choice**: tune's
  first-ranked configuration against the best measured.

The cut is the tuning's (``--balance-by``; profiled time by default, which on these shared
cores may cut differently run to run): each run writes its cuts (``cuts``).

The link tune is given is the one measured here first (:func:`measure_link`): a ping-pong
between two gloo ranks at 4 KiB to 4 MiB, one-way times fitted to ``latency + bytes / link``
(what a user on other hardware would pass as ``link=`` and ``latency=``).
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

SCHEDULES = ("1f1b", "interleaved1f1b", "zbv")
MIB = float(1 << 20)


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


def cut(plan: Any) -> Dict[str, Any]:
    """What the stages were cut by, and each stage's first node: runs cut alike compare."""
    firsts: Dict[int, str] = {}
    for node, stage in plan.assignment.items():
        firsts.setdefault(int(stage), node)
    return {"balance_by": plan.balance_by, "first_nodes": [firsts[s] for s in sorted(firsts)]}


def _ping_pong(rank: int, port: int, out: str, rounds: int = 30) -> None:
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    found = []
    for size in LINK_SIZES:
        t = torch.zeros(size // 4)
        times = []
        for i in range(rounds + 5):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 5:  # warm-up rounds first
                times.append((time.perf_counter() - t0) / 2)
        found.append(sorted(times)[len(times) // 2])  # the median one-way time
    loaded = [_loaded_send(rank, size) for size in LINK_SIZES]
    if rank == 0:
        torch.save({"one_way": found, "loaded": loaded}, out)
    dist.destroy_process_group()


def _loaded_send(rank: int, size: int, rounds: int = 30, trials: int = 3) -> float:
    """What one send costs each rank's own time while both ranks compute, as in a pipeline:
    rounds of a few milliseconds of matmuls, then one send, the two ranks taking turns to
    send and receive, against the same rounds without sends (fastest of ``trials`` each)."""
    import time

    import torch.distributed as dist

    a = torch.randn(256, 256)
    sent, got = torch.zeros(size // 4), torch.empty(size // 4)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(trials):
        for sends in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(rounds):
                for _ in range(12):
                    a @ a
                if sends:
                    (dist.isend(sent, 1 - rank) if (i + rank) % 2 == 0 else dist.irecv(got, 1 - rank)).wait()
            best[sends] = min(best[sends], (time.perf_counter() - t0) / rounds)
    return max(best[True] - best[False], 0.0)


LINK_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def measure_link(tmp: Path) -> Dict[str, Any]:
    """The link between two gloo ranks here: median one-way times of a ping-pong per size, and
    their least-squares fit ``latency + bytes / bytes_per_s``; and what a send costs the ranks'
    own time when both are busy (:func:`_loaded_send`), whose fit's intercept is tune's
    ``send_overhead``: on these two shared cores gloo's I/O threads wait for a core."""
    import numpy as np

    from fxpipe.distributed._launch import free_port

    out = tmp / "link.pt"
    mp.start_processes(_ping_pong, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    measured = torch.load(out)
    one_way, loaded = measured["one_way"], measured["loaded"]
    sizes = np.array(LINK_SIZES, dtype=float)
    slope, latency = np.polyfit(sizes, np.array(one_way), 1)
    _, overhead = np.polyfit(sizes, np.array(loaded), 1)
    return {"sizes": LINK_SIZES, "one_way_s": one_way, "latency_s": max(float(latency), 0.0),
            "bytes_per_s": float(1.0 / slope) if slope > 0 else float("inf"),
            "loaded_send_s": loaded, "send_overhead_s": max(float(overhead), 0.0)}


def _rank(rank: int, world: int, port: int, model: Any, x: torch.Tensor, configs: List[Dict[str, Any]],
          out: str, steps: int = 5) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.distributed.trace import record
    from fxpipe.tuning._orders import measured_orders

    from _memory import Meter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    with torch.no_grad():
        y = torch.zeros_like(model(x).float())
    found = []
    for cfg in configs:
        held: Dict[str, Any] = {}
        meter = Meter()

        def build_and_step() -> None:  # profiled from before the build: every free is seen
            held["pipe"] = pipe = fpd.pipeline(model, x, loss_fn=_loss, timeout=300, progress=False, **cfg["kwargs"])
            for p in pipe.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)  # static, like the parameters: made before the base
            gc.collect()
            meter.mark(1)  # the base: the built pipeline, its receive buffers, parameters and .grad
            pipe.step(x, target=y)  # warm-up
            for p in pipe.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            gc.collect()
            dist.barrier()
            meter.mark(2)
            pipe.step(x, target=y)  # measured
            meter.mark(3)

        try:
            mem = meter.run(build_and_step)
            phases = {ph["label"]: ph for ph in mem["phases"]}
            base = phases[1]["start_bytes"]
            low = phases[2]["min_bytes"]  # what the pipeline holds all through the step
            mem = {"peak_bytes": phases[2]["peak_bytes"] - low, "end_bytes": phases[3]["start_bytes"] - low,
                   "start_bytes": phases[2]["start_bytes"] - low, "held_bytes": low - base}
            with record(held["pipe"]) as trace:
                held["pipe"].step(x, target=y)
            times = _timed_steps(held["pipe"], x, y, steps)
        finally:
            if "pipe" in held:
                held["pipe"].close()
        held.clear()
        gc.collect()
        orders = measured_orders(trace.spans)
        found.append({"peak_bytes": mem["peak_bytes"], "end_bytes": mem["end_bytes"], "start_bytes": mem["start_bytes"],
                      "held_bytes": mem["held_bytes"], "step_s": times,
                      "order": [str(a) for a in orders.get(rank, [])]})
    for cfg, got in zip(configs, found):  # a second pass, minutes later: load that came and went
        pipe = fpd.pipeline(model, x, loss_fn=_loss, timeout=300, progress=False, **cfg["kwargs"])
        try:
            pipe.step(x, target=y)  # warm-up
            got["step_s"] += _timed_steps(pipe, x, y, steps)
        finally:
            pipe.close()
        del pipe
        gc.collect()
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _timed_steps(pipe: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> List[float]:
    """``steps`` step times of this rank, each step started together (a barrier before it)."""
    import time

    import torch.distributed as dist

    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        times.append(time.perf_counter() - t0)
    return times


def run(model: Any, x: torch.Tensor, world: int, chunks: List[int], tmp: Path, what: str,
        balance_by: Any = None, steps: int = 5) -> Dict[str, Any]:
    import time

    import fxpipe
    from fxpipe.distributed._launch import free_port
    from fxpipe.tuning._orders import torch_orders

    here = Path(__file__).resolve().parent  # the ranks import this module, and the zoo's models
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), str(here.parent / "tests"),
                                                os.environ.get("PYTHONPATH", "")])
    link = measure_link(tmp)
    t0 = time.perf_counter()
    tuning = fxpipe.tune(model, x, world, None, schedules=SCHEDULES, chunks=chunks, optimizer="sgd",
                         balance_by=balance_by, link=link["bytes_per_s"], latency=link["latency_s"],
                         send_overhead=link["send_overhead_s"],
                         zero_grad="in_place",  # the ranks zero .grad in place between steps
                         replicas=())  # one pipeline over every rank: the ranks below build without mesh=
    tune_s = time.perf_counter() - t0
    print(f"\n{what}, {world} gloo ranks: gloo link measured {link['latency_s'] * 1e3:.2f} ms + bytes / "
          f"{link['bytes_per_s'] / 1e9:.2f} GB/s, a send costing each busy rank "
          f"{link['send_overhead_s'] * 1e3:.2f} ms; fxpipe.tune took {tune_s:.1f} s\n{tuning}")
    chosen = [c for c in tuning.choices if c.fits]
    configs = [{"kwargs": c.kwargs} for c in chosen]
    ctx = mp.start_processes(_rank, args=(world, free_port(), model, x, configs, str(tmp), steps), nprocs=world,
                             join=True, start_method="spawn")
    del ctx
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    rows, timed = [], []
    for i, c in enumerate(chosen):
        # a step lasts until its last rank is done; other work on the machine only adds time
        measured_s = min(max(ranks[r][i]["step_s"][k] for r in range(world)) for k in range(2 * steps))
        timed.append({"schedule": c.schedule, "chunks": c.chunks, "checkpoint": c.checkpoint, "predicted_s": c.step_s,
                      "measured_s": measured_s, "time_ratio": c.step_s / measured_s})
        predicted_order = torch_orders(c.schedule, world, c.chunks)
        for r in range(world):
            got = ranks[r][i]
            pred = c.activation_bytes[str(r)]
            rows.append({"schedule": c.schedule, "stages": c.n_stages, "chunks": c.chunks, "checkpoint": c.checkpoint,
                         "rank": r, "predicted_bytes": pred, "static_bytes": c.static_bytes[str(r)],
                         "measured_bytes": got["peak_bytes"], "end_bytes": got["end_bytes"],
                         "start_bytes": got["start_bytes"], "held_bytes": got["held_bytes"],
                         "memory_ratio": pred / got["peak_bytes"] if got["peak_bytes"] else float("nan"),
                         "order_same": got["order"] == [str(a) for a in predicted_order[r]],
                         "actions": len(got["order"])})
    cuts = {str(c.n_stages): cut(c.plan) for c in chosen}
    first, best = timed[0], min(timed, key=lambda t: t["measured_s"])  # chosen: tune's ranking
    choice = {"first": [first["schedule"], first["chunks"], first["checkpoint"]],
              "best_measured": [best["schedule"], best["chunks"], best["checkpoint"]],
              "ratio": first["measured_s"] / best["measured_s"]}
    return {"model": what, "world": world, "tune_s": tune_s, "link": link, "cuts": cuts, "rows": rows, "times": timed,
            "choice": choice,
            "skipped": [f"{c.schedule} chunks {c.chunks} {c.checkpoint}: {c.why}" for c in tuning.choices if not c.fits]}


def print_table(res: Dict[str, Any]) -> None:
    print(f"\n{res['model']}, {res['world']} gloo ranks")
    print("| schedule | stages | chunks | checkpoint | rank | predicted MiB | measured MiB | pred/meas | "
          "static MiB (predicted) | order = simulated |")
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|---|")
    for r in res["rows"]:
        print(f"| {r['schedule']} | {r['stages']} | {r['chunks']} | {r['checkpoint']} | {r['rank']} | "
              f"{r['predicted_bytes'] / MIB:.2f} | {r['measured_bytes'] / MIB:.2f} | {r['memory_ratio']:.3f} | "
              f"{r['static_bytes'] / MIB:.2f} | {'yes' if r['order_same'] else 'NO'} ({r['actions']} actions) |")
    for s in res["skipped"]:
        print(f"not built: {s}")
    print("\n| schedule | chunks | checkpoint | predicted ms | measured ms | pred/meas |")
    print("|---|--:|---|--:|--:|--:|")
    for t in sorted(res["times"], key=lambda t: t["measured_s"]):
        print(f"| {t['schedule']} | {t['chunks']} | {t['checkpoint']} | {t['predicted_s'] * 1e3:.1f} | "
              f"{t['measured_s'] * 1e3:.1f} | {t['time_ratio']:.2f} |")
    c = res["choice"]
    print(f"tune's first: {' '.join(map(str, c['first']))}; best measured: {' '.join(map(str, c['best_measured']))}; "
          f"first / best (time) {c['ratio']:.3f}")
