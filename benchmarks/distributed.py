"""fxpipe.distributed vs torch.distributed.pipelining driven by hand, in one run, on gloo ranks.

The script spawns ``--nproc`` ranks itself (torch.multiprocessing, gloo on 127.0.0.1; ``--device
cuda`` is NCCL, one GPU per rank, the group started by the script as a user would), waits a
bounded time (``--deadline``) and kills them if they overrun. ``--stages-per-rank 2`` runs the
looped and V schedules with two stages per rank: with ``--nproc 1 --schedules zbv`` that is a
whole NCCL step on one GPU (torch hands activations between a rank's stages by a function
call). On each schedule (``--schedules``, default gpipe and 1f1b):

* **same_split** (``Stack``: 8 equal residual MLP blocks): ``fxpipe.distributed.pipeline``
  (its default plan, ``checkpoint='never'``) against the peer: ``torch.distributed.pipelining
  .pipeline()`` with ``SplitPoint.BEGINNING`` at the first module of each of fxpipe's stages,
  ``pipe.build_stage``, the same schedule class, chunks and loss scaling. Goal: <= 1.05x.
* **unbalanced** (``Funnel``: narrow token-wise blocks, then a wide head): fxpipe with
  ``balance_by='time'`` against the peer split into equal parameter counts (it has no
  balancer). fxpipe's default ``balance_by='params'`` is shown too. Goal: <= 0.8x.

Before timing, every contender's loss and every gradient (gathered from all ranks) must match
eager ``loss_fn(model(x), y).backward()`` on the whole batch, or the run stops (and on
same_split each rank's fxpipe stage and peer stage must hold the same parameters). Steps are
timed with the contenders interleaved (the order rotates every repetition), each step after a
barrier; a step's time is the slowest rank's. Then, untimed: the bubble fraction per rank
(``fxpipe.distributed.trace.bubble_fractions``: the share of a rank's step time outside its
stages' forward/backward and the loss; spans from ``fxpipe.distributed.trace.record`` for
fxpipe, which takes only fxpipe's pipelines, and from ``_dist_parts.BusyRecorder`` for
every contender, the peer's bubble included),
the memory per rank (``_memory.cpu_peak`` on CPU, ``max_memory_allocated`` on CUDA), and each
rank's stage forward + backward on one micro-batch run alone (ranks take turns): the
per-stage cost a balancer equalises, free of the ranks competing for cores. A probe before
and after each timing (``_parallelism``) says how many ranks could compute at once: the
balance gain needs about one free core per rank.

Usage::

    .venv/bin/python benchmarks/distributed.py                 # full run, writes results/distributed.json
    .venv/bin/python benchmarks/distributed.py --quick         # smoke run, small models, 3 repetitions
    .venv/bin/python benchmarks/distributed.py --device cuda --nproc 2   # NCCL, one GPU per rank
    .venv/bin/python benchmarks/distributed.py --device cuda --nproc 1 --stages-per-rank 2 --schedules zbv  # one GPU
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: worker threads start with it
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from _dist_parts import (BusyRecorder, Peer, cuts_of_plan, equal_param_cuts, make_case, stage_inputs,  # noqa: E402
                         stage_seconds)
from _dist_report import summarise, table  # noqa: E402
from _spawn import spawn_ranks  # noqa: E402
from _memory import cpu_peak  # noqa: E402

RESULTS = os.path.join(HERE, "results", "distributed.json")
#: scenario -> [(contender, how it is built)]; the last one is the peer every ratio is against
CONTENDERS = {
    "same_split": [("fxpipe", "params"), ("peer", "fxpipe cut")],
    "unbalanced": [("fxpipe time", "time"), ("fxpipe params", "params"), ("peer equal-params", "equal params")],
}
GOALS = {"same_split": ("fxpipe", 1.05), "unbalanced": ("fxpipe time", 0.8)}


class Contender:
    """One way to run a training step on this rank: ``step()`` returns the loss (or None where
    the rank does not have it); ``named_parameters`` are this rank's."""

    def __init__(self, name: str, step: Callable[[], Optional[torch.Tensor]], named_parameters: Callable[[], Any],
                 close: Callable[[], None] = lambda: None, split: Any = None, pipe: Any = None) -> None:
        self.name, self.step, self.named_parameters, self.close, self.split = name, step, named_parameters, close, split
        self.pipe = pipe  # fxpipe's DistributedPipeline, for fxpipe.distributed.trace.record

    def zero_grad(self, set_to_none: bool) -> None:
        for _, p in self.named_parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def _build(scenario: str, schedule: str, a: argparse.Namespace, rank: int, world: int, device: torch.device,
           loss_fn: Callable, notes: List[str]) -> List[Contender]:
    """The scenario's contenders on this rank, checked exact against eager."""
    import fxpipe.distributed as fpd
    from fxpipe.distributed import SCHEDULES
    from fxpipe.distributed._schedules import stages_of_rank

    model, x, y = make_case(scenario, a.quick)
    model, x, y = model.to(device), x.to(device), y.to(device)
    out: List[Contender] = []
    cut = None
    for name, how in CONTENDERS[scenario]:
        if name.startswith("fxpipe"):
            try:
                pipe = fpd.pipeline(copy.deepcopy(model), x, chunks=a.chunks, loss_fn=loss_fn, schedule=schedule,
                                    stages_per_rank=a.stages_per_rank, balance_by=how, checkpoint="never",
                                    timeout=a.timeout)
            except Exception as e:  # e.g. CUDA not supported yet: say so, still run the peer
                notes.append(f"{scenario}/{schedule}: fxpipe.distributed.pipeline raised {type(e).__name__}: {e}")
                continue
            plan = pipe.plan
            if name == "fxpipe":  # the peer's cut (ValueError if SplitPoint cannot express it)
                cut = cuts_of_plan(pipe.capture.graph_module, plan.assignment, plan.n_stages)
            out.append(Contender(name, lambda p=pipe: p.step(x, target=y), pipe.named_parameters, pipe.close,
                                 {"stage_starts": [s.nodes[0] for s in plan.stages][1:], "balance_by": how,
                                  "stage_costs": [s.cost for s in plan.stages]}, pipe))
        else:
            n_stages = world * a.stages_per_rank
            spec = equal_param_cuts(model, n_stages) if how == "equal params" or cut is None else cut
            if how == "fxpipe cut" and cut is None:
                notes.append(f"{scenario}/{schedule}: no fxpipe plan, so the peer was split into equal parameters")
            peer_model = copy.deepcopy(model)  # pipeline() annotates the module it splits
            local = stages_of_rank(schedule, world, a.stages_per_rank, rank)
            peer = Peer(peer_model, x, spec, a.chunks, SCHEDULES[schedule].torch_class(a.stages_per_rank), loss_fn,
                        local, n_stages, device)
            out.append(Contender(name, lambda p=peer: p.step(x, y), peer.named_parameters,
                                 split={"cuts": list(spec), "how": how}))
    checked = _check_exact(out, model, x, y, loss_fn, notes, f"{scenario}/{schedule}")
    if scenario == "same_split" and len(checked) == 2:  # the same split: the same parameters on this rank
        fx, peer = ({n for n, _ in c.named_parameters()} for c in checked)
        if fx != peer:
            raise AssertionError(f"rank {rank}: fxpipe's stage and the peer's hold different parameters: "
                                 f"{sorted(fx ^ peer)}")
    return checked


def _check_exact(contenders: List[Contender], model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: Callable, notes: List[str], key: str) -> List[Contender]:
    """Every contender's loss and gradients (all ranks' gathered) against eager on the whole
    batch; a mismatch stops the run. An fxpipe contender whose step raises on any rank (e.g.
    on CUDA, not supported yet) is dropped, with a note, on every rank."""
    import torch.distributed as dist

    eager = copy.deepcopy(model)
    want = loss_fn(eager(x), y)
    want.backward()
    grads = {n: p.grad for n, p in eager.named_parameters()}
    kept = []
    for c in contenders:
        c.zero_grad(set_to_none=True)
        failed: Optional[str] = None
        try:
            loss = c.step()
        except Exception as e:
            if not c.name.startswith("fxpipe"):
                raise
            failed = f"{key}: {c.name} step raised {type(e).__name__}: {e}"
        errors: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, failed)
        if any(errors):
            notes.extend(f"rank {r}: {m}" for r, m in enumerate(errors) if m)
            continue
        kept.append(c)
        if loss is not None:
            torch.testing.assert_close(loss, want.detach(), msg=lambda m: f"{c.name} loss: {m}")
        mine = {n: p.grad.cpu() for n, p in c.named_parameters() if p.grad is not None}
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        merged = {n: g for d in every for n, g in d.items()}
        if set(merged) != set(grads):
            raise AssertionError(f"{c.name}: gradients for {sorted(set(merged) ^ set(grads))} missing or extra")
        for n, g in merged.items():
            torch.testing.assert_close(g, grads[n].cpu(), msg=lambda m: f"{c.name} {n}: {m}")
        c.zero_grad(set_to_none=True)
    return kept


def _time(contenders: List[Contender], a: argparse.Namespace, sync: Callable[[], None]) -> Dict[str, List[float]]:
    """Seconds per step on this rank, contenders interleaved (order rotated every repetition)."""
    import torch.distributed as dist

    times: Dict[str, List[float]] = {c.name: [] for c in contenders}
    for rep in range(a.warmup + a.repeat):
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            c.zero_grad(set_to_none=True)
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            c.step()
            sync()
            if rep >= a.warmup:
                times[c.name].append(time.perf_counter() - t0)
    return times


def _bubbles(contenders: List[Contender], steps: int, sync: Callable[[], None]) -> Dict[str, Dict[str, Any]]:
    """Untimed, instrumented steps per contender on this rank: ``spans``, this rank's
    (kind, start, end) from :class:`BusyRecorder` (every contender: the same instrument), and
    for an fxpipe contender also ``shared``, every rank's bubble from fxpipe's own recorder
    (``fxpipe.distributed.trace.record``, which takes only a DistributedPipeline)."""
    import torch.distributed as dist

    from fxpipe.distributed.trace import bubble_fractions, record

    out: Dict[str, Dict[str, Any]] = {}
    for c in contenders:
        rec = BusyRecorder(sync)
        with rec.installed(), (record(c.pipe) if c.pipe is not None else contextlib.nullcontext()) as trace:
            for _ in range(steps):
                c.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                c.step()
                sync()
                rec.spans.append(("step", t0, time.perf_counter()))
        out[c.name] = {"spans": rec.spans, "shared": bubble_fractions(trace.spans) if trace is not None else None}
    return out


def _alone(contenders: List[Contender], repeats: int, sync: Callable[[], None]) -> Dict[str, float]:
    """Seconds of this rank's stage forward + backward on one micro-batch with the other ranks
    waiting at a barrier (ranks take turns): each stage's compute without the other ranks
    competing for the cores. Replays the inputs recorded in one real step."""
    import torch.distributed as dist

    out: Dict[str, float] = {}
    for c in contenders:
        with stage_inputs() as seen:
            c.step()
        module, inputs = seen[0]
        for r in range(dist.get_world_size()):
            dist.barrier()
            if r == dist.get_rank():
                out[c.name] = stage_seconds(module, inputs, repeats, sync)
        dist.barrier()
        c.zero_grad(set_to_none=True)
    return out


def _parallelism(device: torch.device, sync: Callable[[], None], rounds: int = 3) -> Dict[str, List[float]]:
    """How many ranks really compute at once on this machine now: the same fixed work (40
    matmuls 256 x 256), run by each rank in turn and then by all at once after a barrier;
    seconds per round. Parallelism = sum of the turns / slowest simultaneous run: the rank
    count with a free core each, about 1 when the ranks share one core's worth of time (then
    no split can make a step faster than the total work)."""
    import torch.distributed as dist

    a = torch.randn(256, 256, device=device)

    def work() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(40):
            a @ a
        sync()
        return time.perf_counter() - t0

    out: Dict[str, List[float]] = {"alone": [], "together": []}
    for _ in range(rounds):
        for r in range(dist.get_world_size()):
            dist.barrier()
            if r == dist.get_rank():
                out["alone"].append(work())
        dist.barrier()
        out["together"].append(work())
    return out


def _memory(contenders: List[Contender], device: torch.device, sync: Callable[[], None]) -> Dict[str, Dict[str, Any]]:
    """Per contender on this rank: peak bytes allocated during one step above the step's start
    (gradients zeroed in place first, so the step allocates no new .grad), and the bytes of
    the parameters this rank's stages use."""
    import torch.distributed as dist

    out: Dict[str, Dict[str, Any]] = {}
    for c in contenders:
        c.zero_grad(set_to_none=False)
        dist.barrier()
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            c.step()
            sync()
            m = {"peak_bytes": torch.cuda.max_memory_allocated(device) - before,
                 "end_bytes": torch.cuda.memory_allocated(device) - before, "how": "cuda max_memory_allocated - before"}
        else:
            m = cpu_peak(lambda: c.step())
        m["param_bytes"] = sum(p.numel() * p.element_size() for _, p in c.named_parameters())
        out[c.name] = m
    return out


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=3 * a.timeout),
                            **({"device_id": device} if cuda else {}))  # outlasts a failing pipeline's timeout
    result: Dict[str, Any] = {"rank": rank, "notes": [], "runs": {}}
    for scenario in a.scenarios:
        for schedule in a.schedules:
            contenders = _build(scenario, schedule, a, rank, world, device, F.mse_loss, result["notes"])
            run = {"splits": {c.name: c.split for c in contenders}, "parallelism": [_parallelism(device, sync)]}
            run["times"] = _time(contenders, a, sync)
            run["parallelism"].append(_parallelism(device, sync))
            run["bubble"] = _bubbles(contenders, a.bubble_steps, sync)
            run["memory"] = _memory(contenders, device, sync)
            run["alone"] = _alone(contenders, a.alone_repeats, sync)
            result["runs"][f"{scenario}/{schedule}"] = run
            for c in contenders:
                c.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _spawn(a: argparse.Namespace) -> List[Dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_worker, (a.nproc, port, a, tmp), a.nproc, a.deadline)
        ranks = []
        for r in range(a.nproc):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        return ranks


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, 3 repetitions")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks = pipeline stages")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps per contender (default 40; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    parser.add_argument("--bubble-steps", type=int, default=None, help="instrumented steps (default 10; quick 1)")
    parser.add_argument("--alone-repeats", type=int, default=None,
                        help="runs of each stage alone, per micro-batch (default 20; quick 2)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1,
                        help="2: the looped and V schedules (gpipe, interleaved1f1b, interleavedzb, zbv)")
    parser.add_argument("--scenarios", default="same_split,unbalanced")
    parser.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument("--deadline", type=float, default=1200.0, help="kill the ranks after this many seconds")
    parser.add_argument("--output", default=RESULTS)
    a = parser.parse_args(argv)
    a.repeat = a.repeat or (3 if a.quick else 40)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.bubble_steps = a.bubble_steps or (1 if a.quick else 10)
    a.alone_repeats = a.alone_repeats or (2 if a.quick else 20)
    a.schedules = a.schedules.split(",")
    a.scenarios = a.scenarios.split(",")
    if a.device == "cuda" and torch.cuda.device_count() < a.nproc:
        parser.error(f"--device cuda needs one GPU per rank: {a.nproc} ranks, {torch.cuda.device_count()} GPUs")
    started, load = time.perf_counter(), os.getloadavg()
    ranks = _spawn(a)
    runs = summarise(ranks, GOALS)
    notes = sorted({n for r in ranks for n in r["notes"]})
    result = {
        "command": " ".join(["python", "benchmarks/distributed.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(), "device": a.device, "nproc": a.nproc, "chunks": a.chunks,
        "repeat": a.repeat, "warmup": a.warmup, "bubble_steps": a.bubble_steps, "torch": torch.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "load_avg_before": load, "load_avg_after": os.getloadavg(), "wall_s": time.perf_counter() - started,
        "notes": notes,
        "memory_how": ("cuda max_memory_allocated minus memory_allocated before one step" if a.device == "cuda" else
                       "benchmarks/_memory.py cpu_peak: allocator bytes during one step above its start "
                       "(grads zeroed in place first), raw profiler [memory] records"),
        "bubble_how": "fxpipe.distributed.trace.bubble_fractions: per rank, the share of its step time not "
                      "covered by forward/backward/weight/loss spans; spans: fxpipe.distributed.trace.record "
                      "('shared', fxpipe only) and benchmarks/_dist_parts.py BusyRecorder ('local', all)",
        "runs": runs,
    }
    if not a.quick or a.output != RESULTS:
        os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
        with open(a.output, "w") as f:
            json.dump(result, f, indent=1)
    print(table(runs))
    for key, run in runs.items():
        g = run["goal"]
        if g["met"] is None:
            print(f"{key}: {g['contender']} was not measured (see the notes)")
        else:
            r = run["contenders"][g["contender"]]["ratio"]
            print(f"{key}: {g['contender']} / {run['peer']} = {r:.3f} (goal <= {g['ratio']}: "
                  f"{'met' if g['met'] else 'NOT met'})")
    for n in notes:
        print("note:", n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
