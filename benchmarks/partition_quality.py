"""Partition quality: how close to a perfect split is each balancing policy?

Score of a split into n stages: ``bottleneck stage time / (total time / n)``. Lower is
better; 1.0 is a perfect split (the pipeline's steady-state step is set by its slowest stage).

Every split is scored on the SAME per-node costs: each model is captured once and profiled
``--profiles`` times with ``fxpipe.plan._make.opgraph_for(captured, args, kwargs, 'time')``
(forward + backward seconds per fx node); the per-node median over those profiles is the
shared cost table, and ``fxpipe.plan._partition.stage_costs(graph, assignment, cost_attr="seconds")`` turns any
assignment into stage times. So the comparison measures the split, not the timing noise.

Contenders (all cut the same topological order into contiguous stages):

* ``fxpipe``: ``fxpipe.plan._make.make_plan(captured, args, kwargs, n, balance_by='time',
  devices=[cpu]*n)`` -- what ``fxpipe.pipeline`` uses. It profiles again on its own, so its
  plan is optimal for *its* profile; scored here on the shared one.
* ``opt``: ``fxpipe.plan._partition.partition`` run on the shared costs: the exact optimum for this
  order and these costs (a lower bound for every contender; shows how much the difference
  between fxpipe's own profile and the shared one costs).
* ``opt-holdout``: the same exact partitioner run on a second, independent median of
  ``--profiles`` profiles, scored on the shared one: the noise floor of any time-based
  split on this machine (how much two equally good profiles disagree).
* ``params-opt``: ``make_plan(..., balance_by='params')``: the optimal equal-parameter split
  (minimises the largest stage parameter count).
* ``params-greedy``: the typical parameter-count policy, as in PiPPy's
  ``split_into_equal_size`` (no longer shipped with torch.distributed.pipelining in torch
  2.13, so re-implemented here): walk the nodes in order and start a new stage before the
  node that would push the current stage past ``total_params / n``, at most ``n - 1`` cuts.
  It may use fewer than n stages; the score still divides by ``total / n``.
* ``torchgpipe``: ``torchgpipe.balance.balance_by_time(n, seq, sample, device='cpu')``
  (torchgpipe 0.0.7), only where the model is an ``nn.Sequential`` (the zoo's
  ``bn_model.net``, and the two Sequential benchmark models below). Its per-layer balance is
  mapped to graph nodes: a stage starts at the first compute node of its first layer.
* ``fxpipe.balance``: ``fxpipe.balance.balance_by_time`` (the torchgpipe-compatible API),
  Sequential models only, mapped the same way.

Models: every model in ``tests/zoo.py`` plus two Sequential benchmark models defined here,
``seq_mlp`` (Linear layers of very uneven widths; time and parameters are nearly
proportional, so parameter splits should do well) and ``seq_conv`` (a conv stack that
down-samples: early high-resolution convs are slow with few parameters, the classifier has
many parameters and is cheap; the case where parameter balancing goes wrong).

Usage::

    .venv/bin/python benchmarks/partition_quality.py            # writes results/partition_quality.json
    .venv/bin/python benchmarks/partition_quality.py --profiles 3 --models unet,seq_conv
    python benchmarks/partition_quality.py --device cuda --profiles 3   # writes partition_quality-cuda.json

``--device cuda``: each model and its sample live on ``cuda:0``; every profile, fxpipe's plan
(``devices=['cuda:0'] * n``) and torchgpipe's ``balance_by_time(device='cuda:0')`` then time
GPU kernels (CUDA synchronized around each timing), so the scores are those of a GPU split.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import networkx as nx  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe.balance as fx_balance  # noqa: E402
from _results import header, write_json  # noqa: E402
from _device import add_device_argument, check_device, first_device, label  # noqa: E402
from fxpipe.capture._tracing import capture  # noqa: E402
from fxpipe.plan._partition import COMPUTE_OPS, partition, stage_costs, topological_order  # noqa: E402
from fxpipe.plan._make import make_plan, opgraph_for, split_nodes  # noqa: E402
from zoo import ZOO  # noqa: E402

torch.set_num_threads(1)
CPU = torch.device("cpu")
NS = (2, 4, 8)


# -- Sequential benchmark models -------------------------------------------------------------
class SeqModel(nn.Module):
    """Wraps an nn.Sequential as ``.net`` so every model is captured the same way."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def seq_mlp(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    widths = [256, 2048, 128, 1024, 64, 3072, 256, 512, 32, 2048, 1024, 128, 512, 64, 1536, 10]
    layers: List[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return SeqModel(nn.Sequential(*layers[:-1])), (torch.randn(64, widths[0]),), {}


def seq_conv(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    cin = 3
    for cout, stride in [(32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)]:
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 1000)]
    return SeqModel(nn.Sequential(*layers)), (torch.randn(8, 3, 64, 64),), {}


EXTRA: Dict[str, Callable[..., tuple]] = {"seq_mlp": seq_mlp, "seq_conv": seq_conv}


def sequential_of(model: nn.Module) -> Optional[tuple[str, nn.Sequential]]:
    """(qualified name, module) of the nn.Sequential that IS the whole model, if any."""
    if isinstance(model, nn.Sequential):
        return "", model
    children = list(model.named_children())
    if len(children) == 1 and isinstance(children[0][1], nn.Sequential):
        return children[0]
    return None


# -- scoring -----------------------------------------------------------------------------------
def shared_costs(captured: Any, args: tuple, kwargs: dict, profiles: int) -> nx.DiGraph:
    """One OpGraph whose node ``cost`` is the median over ``profiles`` time profiles."""
    graphs = [opgraph_for(captured, args, kwargs, "time") for _ in range(profiles)]
    g = graphs[0]
    for node in g.nodes:
        g.nodes[node]["seconds"] = statistics.median(float(h.nodes[node]["seconds"]) for h in graphs)
    return g


def compute_nodes(graph: nx.DiGraph) -> List[str]:
    return [n for n in topological_order(graph) if graph.nodes[n].get("op") in COMPUTE_OPS]


def greedy_params_cuts(graph: nx.DiGraph, n: int) -> List[str]:
    """Nodes before which the greedy equal-parameter policy starts a new stage."""
    order = compute_nodes(graph)
    params = [float(graph.nodes[v].get("params") or 0.0) for v in order]
    threshold = sum(params) / n
    cuts: List[str] = []
    cur = 0.0
    for v, w in zip(order, params):
        if cur > 0 and cur + w > threshold and len(cuts) < n - 1:
            cuts.append(v)
            cur = w
        else:
            cur += w
    return cuts


def assignment_from_cuts(graph: nx.DiGraph, cuts: Sequence[str]) -> Dict[str, int]:
    """Full node -> stage assignment for stages starting at ``cuts`` (same glue as partition)."""
    return partition(graph, len(cuts) + 1, cost_attr="seconds", split_before=list(cuts))


def cuts_from_balance(captured: Any, graph: nx.DiGraph, prefix: str, balance: Sequence[int]) -> List[str]:
    """Per-layer balance of a Sequential -> the first graph node of each stage's first layer."""
    starts, i = [], 0
    for b in balance[:-1]:
        i += b
        starts.append(f"{prefix}.{i}" if prefix else str(i))
    return split_nodes(captured, graph, starts)


def score(graph: nx.DiGraph, assignment: Dict[str, int], n: int) -> Dict[str, Any]:
    costs = stage_costs(graph, assignment, cost_attr="seconds")
    total = sum(float(d.get("seconds") or 0.0) for _, d in graph.nodes(data=True))
    bottleneck = max(costs)
    return {
        "ratio": bottleneck / (total / n),
        "bottleneck_s": bottleneck,
        "stage_costs_s": costs,
        "stages_used": sum(1 for c in costs if c > 0) if costs else 0,
        "params_per_stage": [
            sum(float(graph.nodes[v].get("params") or 0.0) for v, s in assignment.items() if s == k)
            for k in range(len(costs))
        ],
    }


# -- the benchmark ---------------------------------------------------------------------------
def run_model(name: str, factory: Callable[..., tuple], profiles: int, tg_timeout: float,
              dev: torch.device = CPU) -> List[Dict[str, Any]]:
    import torchgpipe.balance as tg_balance

    model, args, kwargs = factory()
    model = model.to(dev)
    args = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in args)
    kwargs = {k: t.to(dev) if isinstance(t, torch.Tensor) else t for k, t in kwargs.items()}
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, args, kwargs)
    graph = shared_costs(captured, args, kwargs, profiles)
    holdout = shared_costs(captured, args, kwargs, profiles)
    m = len(compute_nodes(graph))
    seq = sequential_of(model)
    rows: List[Dict[str, Any]] = []
    for n in NS:
        if n > m:
            continue
        found: Dict[str, Dict[str, int]] = {}
        t0 = time.perf_counter()
        found["fxpipe"] = make_plan(captured, args, kwargs, n, balance_by="time", devices=[dev] * n).assignment
        t_fx = time.perf_counter() - t0
        found["opt"] = partition(graph, n, cost_attr="seconds")
        found["opt-holdout"] = partition(holdout, n, cost_attr="seconds")
        found["params-opt"] = make_plan(captured, args, kwargs, n, balance_by="params", devices=[dev] * n).assignment
        found["params-greedy"] = assignment_from_cuts(graph, greedy_params_cuts(graph, n))
        balances: Dict[str, List[int]] = {}
        if seq is not None and n <= len(seq[1]):
            prefix, net = seq
            sample = args[0]
            balances["torchgpipe"] = list(tg_balance.balance_by_time(n, net, sample, timeout=tg_timeout, device=dev))
            balances["fxpipe.balance"] = list(fx_balance.balance_by_time(n, net, sample, timeout=tg_timeout, device=dev))
            for key, bal in balances.items():
                found[key] = assignment_from_cuts(graph, cuts_from_balance(captured, graph, prefix, bal))
        for contender, assignment in found.items():
            row = {"model": name, "n": n, "compute_nodes": m, "contender": contender, **score(graph, assignment, n)}
            if contender in balances:
                row["layer_balance"] = balances[contender]
            if contender == "fxpipe":
                row["make_plan_s"] = t_fx
            rows.append(row)
    return rows


CONTENDERS = ["fxpipe", "opt", "opt-holdout", "params-opt", "params-greedy", "torchgpipe", "fxpipe.balance"]


def table(rows: List[Dict[str, Any]]) -> str:
    by: Dict[tuple, Dict[str, float]] = {}
    nodes: Dict[str, int] = {}
    for r in rows:
        by.setdefault((r["model"], r["n"]), {})[r["contender"]] = r["ratio"]
        nodes[r["model"]] = r["compute_nodes"]
    head = "| model | nodes | n | " + " | ".join(CONTENDERS) + " |"
    lines = [head, "|---|--:|--:|" + "--:|" * len(CONTENDERS)]
    for (model, n), vals in by.items():
        cells = [f"{vals[c]:.2f}" if c in vals else "-" for c in CONTENDERS]
        lines.append(f"| {model} | {nodes[model]} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Geometric mean of each contender's ratio, over the (model, n) cells it has."""
    out: Dict[str, Any] = {}
    for c in CONTENDERS:
        vals = [r["ratio"] for r in rows if r["contender"] == c]
        if vals:
            out[c] = {"geomean_ratio": float(torch.tensor(vals).log().mean().exp()), "cells": len(vals),
                      "worst_ratio": max(vals)}
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", type=int, default=5, help="time profiles per model; costs are their median")
    p.add_argument("--models", default="", help="comma-separated subset (zoo names, seq_mlp, seq_conv)")
    p.add_argument("--tg-timeout", type=float, default=1.0, help="profiling seconds for balance_by_time")
    p.add_argument("--out", default=None, help="JSON (default results/partition_quality[-cuda].json)")
    p.add_argument("--quick", action="store_true", help="1 profile, tg-timeout 0.3 s, models seq_conv,unet,gpt_tied")
    add_device_argument(p, "the models, samples and every profile live on cuda:0")
    a = p.parse_args(argv)
    if a.quick:
        a.profiles, a.tg_timeout, a.models = 1, 0.3, a.models or "seq_conv,unet,gpt_tied"
    check_device(a.device)
    dev = first_device(a.device)
    a.out = a.out or str(ROOT / "benchmarks" / "results" / f"partition_quality{'' if a.device == 'cpu' else '-cuda'}.json")
    models = {**ZOO, **EXTRA}
    if a.models:
        models = {k: models[k] for k in a.models.split(",")}
    rows: List[Dict[str, Any]] = []
    began = time.perf_counter()
    for name, factory in models.items():
        t0 = time.perf_counter()
        rows += run_model(name, factory, a.profiles, a.tg_timeout, dev)
        print(f"# {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(table(rows))
    summ = summary(rows)
    print()
    print("| contender | geomean ratio | worst | cells |")
    print("|---|--:|--:|--:|")
    for c, s in summ.items():
        print(f"| {c} | {s['geomean_ratio']:.3f} | {s['worst_ratio']:.2f} | {s['cells']} |")
    result = {
        **header("partition_quality", label(a.device), omp_num_threads=os.environ.get("OMP_NUM_THREADS")),
        "profiles": a.profiles,
        "score": "max(stage_costs) / (sum of node costs / n), on the median of `profiles` time profiles",
        "seconds": time.perf_counter() - began,
        "summary": summ,
        "rows": rows,
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
