"""Pipeline x data parallel: fxpipe.distributed on a ('dp', 'pp') mesh vs torch's own
composition driven by hand, in one run, on 4 gloo ranks (2 replicas x 2 pipeline ranks).

* **fxpipe**: ``fxpipe.distributed.pipeline(..., mesh=mesh, data_parallel='ddp' or 'fsdp')``,
  each replica stepping on its shard of the batch: ``'ddp'`` sums the step's gradients over the
  replicas once after the schedule (``fxpipe/distributed/_replicas.py``); ``'fsdp'`` shards the
  stage with FSDP2, reduce-scattering after each micro-batch's backward
  (``fxpipe/distributed/_sharding.py``).
* **peer**: torch.distributed.pipelining's ``pipeline()`` split at fxpipe's cut, each stage
  module wrapped in ``DistributedDataParallel`` over the replica group (or, for ``'fsdp'``,
  made an FSDP2 root with ``fully_shard``), ``PipelineStage`` over the pipeline group (torch's
  stage then syncs DDP, or reduce-scatters FSDP's gradients, on the last backward only), the
  same schedule class and chunks, the loss scaled by ``1/chunks``. Goal: fxpipe <= 1.05x.

Both modes run, one after the other (``'ddp'``, then ``'fsdp'``).

Before timing, both contenders' loss and every gradient (gathered) must equal eager on the
global batch. Steps are timed interleaved (the order alternates), each after a barrier; a
step's time is the slowest rank's; the median is reported. The memory per rank is counted
from the tensors each rank holds after an Adam step: parameters, gradients and optimizer
state; beside it, one pipeline alone (no replicas) on the same 2 ranks and on all 4.

Usage::

    .venv/bin/python benchmarks/data_parallel.py            # writes results/data_parallel.json
    .venv/bin/python benchmarks/data_parallel.py --modes fsdp   # one mode (the other's last results kept)
    .venv/bin/python benchmarks/data_parallel.py --quick    # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from _dist_parts import cuts_of_plan, make_case  # noqa: E402
from _spawn import spawn_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results", "data_parallel.json")
DP, PP = 2, 2
GOAL = 1.05


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _held_bytes(params: List[torch.nn.Parameter], opt: torch.optim.Optimizer) -> Dict[str, int]:
    """What this rank holds (a DTensor's shard, not its global size)."""
    grads = sum(_local(p.grad).nbytes for p in params if p.grad is not None)
    state = sum(_local(v).nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"parameters": sum(_local(p).nbytes for p in params), "gradients": grads, "optimizer": state}


def _gathered_grads(named: List[Any]) -> Dict[str, torch.Tensor]:
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor

    # a DTensor gathered whole: every replica of a stage calls full_tensor in the same order
    mine = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for n, p in named
            if p.grad is not None}
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: Dict[str, torch.Tensor] = {}
    for d in every:
        out.update(d)
    return out


def _check(name: str, grads: Dict[str, torch.Tensor], loss: float, model: torch.nn.Module, x: torch.Tensor,
           y: torch.Tensor) -> None:
    """The contender's step equals eager's on the global batch, or the run stops."""
    ref = copy.deepcopy(model)
    want = F.mse_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(torch.tensor(loss), want.detach(), rtol=1e-4, atol=1e-6, msg=f"{name}: loss")
    flat = {k.replace("_", "."): g for k, g in grads.items()}  # torch's split names blocks_0 for blocks.0
    for n, p in ref.named_parameters():
        got = flat.get(n.replace("_", "."))
        assert got is not None, f"{name}: no gradient for {n}"
        scale = p.grad.abs().max().item() + 1e-12
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5 * scale, msg=f"{name}: {n}")


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, pipeline as torch_pipeline
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import fxpipe.distributed as fpd
    from fxpipe.distributed import SCHEDULES

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    model, x, y = make_case("same_split", a.quick)
    x, y = x.repeat(DP, 1), y.repeat(DP, 1)
    x = x + 0.01 * torch.arange(x.shape[0]).unsqueeze(1)  # the replicas' shards differ
    half = x.shape[0] // DP
    pp_rank, dp_rank = rank % PP, rank // PP
    shard_x, shard_y = x[dp_rank * half:(dp_rank + 1) * half], y[dp_rank * half:(dp_rank + 1) * half]
    device = torch.device("cpu")
    result: Dict[str, Any] = {"schedule": a.schedule, "memory": {}, "seconds": {"fxpipe": [], "peer": []}}
    mode = a.mode

    pipe = fpd.pipeline(copy.deepcopy(model), shard_x, chunks=a.chunks, loss_fn=F.mse_loss, schedule=a.schedule,
                        checkpoint="never", mesh=mesh, data_parallel=mode, timeout=a.timeout)
    fx_opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    cut = cuts_of_plan(pipe.capture.graph_module, pipe.plan.assignment, pipe.plan.n_stages)
    ir = torch_pipeline(copy.deepcopy(model), (shard_x[: half // a.chunks],), split_spec=cut)
    dp_group = mesh["dp"].get_group()
    if mode == "ddp":
        module = DistributedDataParallel(ir.get_stage_module(pp_rank), process_group=dp_group)
    else:  # torch's composability tests' way: the stage module itself is the FSDP root
        module = fully_shard(ir.get_stage_module(pp_rank), mesh=mesh["dp"])
    stage = PipelineStage(module, pp_rank, PP, device, group=mesh["pp"].get_group())
    schedule = SCHEDULES[a.schedule].torch_class(1)(stage, a.chunks, loss_fn=lambda o, t: F.mse_loss(o, t) / a.chunks,
                                                   scale_grads=False)
    peer_opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    peer_named = [(n.removeprefix("module."), p) for n, p in module.named_parameters()]

    def fx_step() -> float:
        return float(pipe.step(shard_x, target=shard_y))

    def peer_step() -> float:
        losses: List[torch.Tensor] = []
        last = pp_rank == PP - 1
        schedule.step(*((shard_x,) if pp_rank == 0 else ()), target=shard_y if last else None,
                      losses=losses if last else None)
        box = torch.tensor([float(sum(t.item() for t in losses)) / DP if last else 0.0])
        dist.all_reduce(box)  # the global batch's loss: the replicas' halves, from each last stage
        return float(box.item())

    # exact first: one step each, compared with eager on the global batch
    loss = fx_step()
    _check("fxpipe", _gathered_grads(list(pipe.named_parameters())), loss, model, x, y)
    loss = peer_step()
    _check("peer", _gathered_grads(peer_named), loss, model, x, y)
    fx_opt.step()
    peer_opt.step()
    result["memory"][f"fxpipe {mode}"] = _held_bytes(list(pipe.parameters()), fx_opt)
    result["memory"][f"peer {mode}"] = _held_bytes(list(module.parameters()), peer_opt)
    for rep in range(a.repeats):
        order = [("fxpipe", fx_step), ("peer", peer_step)]
        for name, step in (order if rep % 2 == 0 else order[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            spent = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            result["seconds"][name].append(float(spent))
    pipe.close()
    if mode == "fsdp":
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        return
    # one pipeline over all 4 ranks, no replicas: each rank holds a quarter of the model
    single = fpd.pipeline(copy.deepcopy(model), x, chunks=a.chunks, loss_fn=F.mse_loss, schedule=a.schedule,
                          checkpoint="never", timeout=a.timeout)
    opt = torch.optim.Adam(single.parameters(), lr=1e-4)
    single.step(x, target=y)
    opt.step()
    result["memory"]["pp alone, 4 ranks"] = _held_bytes(list(single.parameters()), opt)
    single.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _report(ranks: List[Dict[str, Any]], a: argparse.Namespace) -> Dict[str, Any]:
    seconds = ranks[0]["seconds"]  # the slowest rank's time of each step, the same on every rank
    med = {k: statistics.median(v) for k, v in seconds.items()}
    memory = {}
    for label in ranks[0]["memory"]:
        per_rank = [sum(r["memory"][label].values()) for r in ranks]
        memory[label] = {"max_bytes_per_rank": max(per_rank), "per_rank": per_rank,
                         "parts_rank0": ranks[0]["memory"][label]}
    ratio = med["fxpipe"] / med["peer"]
    return {"command": "benchmarks/data_parallel.py" + (" --quick" if a.quick else ""), "layout": f"{DP} dp x {PP} pp",
            "data_parallel": a.mode,
            "schedule": a.schedule, "chunks": a.chunks, "repeats": a.repeats,
            "median_step_s": med, "ratio_fxpipe_vs_peer": ratio, "goal": GOAL, "met": ratio <= GOAL,
            "spread_s": {k: [min(v), max(v)] for k, v in seconds.items()}, "memory": memory,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__}


def main() -> None:
    import tempfile

    from fxpipe.distributed._launch import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=("ddp", "fsdp"))
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--deadline", type=float, default=1800)
    a = p.parse_args()
    a.repeats = a.repeats or (3 if a.quick else 15)
    world = DP * PP
    report = {}
    if not a.quick and set(a.modes) != {"ddp", "fsdp"} and os.path.exists(RESULTS):
        with open(RESULTS) as f:
            report = json.load(f)  # the other mode's last run stays
    for mode in a.modes:
        a.mode = mode
        with tempfile.TemporaryDirectory() as out:
            spawn_ranks(_worker, (world, free_port(), a, out), world, a.deadline)
            ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        report[mode] = _report(ranks, a)
    print(json.dumps(report, indent=2))
    if not a.quick:
        with open(RESULTS, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
