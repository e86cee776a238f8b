"""Planner scaling: seconds per planning phase against the number of fx nodes.

Model: a deep residual MLP of tiny layers with long skips (``DeepResMLP``): block i computes
``x = x + relu(linear_i(x))`` and, from block ``skip`` on, also adds the output of block
``i - skip``; about 4 fx nodes per block (linear, relu, add, add), and every cut is crossed
by ``skip`` live values, so the partitioner's receive table is not trivial. Width 8, batch 2,
so the tensors are tiny and the phases measure the planner, not the math.

Phases, each timed with ``time.perf_counter`` (one run per size; the machine is shared, so
read the trend, not the third digit):

* ``capture``: ``fxpipe.capture._tracing.capture(model, args, kwargs)`` (torch.fx trace).
* ``profile``: ``fxpipe.plan._profile.count_params_only(gm, flat)``, the deterministic, untimed
  profile used by ``balance_by='params'`` (one Interpreter run for shapes and bytes).
* ``opgraph``: ``fxpipe.plan._op_graph.build_opgraph`` plus the parameter folding and memory
  attribute of ``fxpipe.plan._make.opgraph_for`` (the steps of ``opgraph_for`` after profiling).
* ``partition``: ``fxpipe.plan._partition.partition(graph, 8, cost_attr='params')``: compute only.
* ``partition+xfer``: the same with a transfer term (``seconds_per_byte=1``, so received
  activation bytes weigh as much as parameters: the exact search with a receive table,
  the path taken for GPU devices).
* ``plan``: ``fxpipe.plan._value.Plan.from_assignment`` (stages, boundary edges, portals).
* ``emit``: ``fxpipe.emit._stages.emit_stages(gm, plan)``.
* ``time profile`` (reported separately, not in the total): ``fxpipe.plan._profile.profile_graph``,
  what ``balance_by='time'`` pays instead of ``profile``.

Usage::

    .venv/bin/python benchmarks/planner_scaling.py                    # 250 .. 20k nodes
    .venv/bin/python benchmarks/planner_scaling.py --max-nodes 5000   # smaller sweep
    .venv/bin/python benchmarks/planner_scaling.py --no-time-profile  # skip the timed profile
    python benchmarks/planner_scaling.py --device cuda --quick        # up to 1000 nodes, on cuda:0

``--device cuda`` puts the model and its input on ``cuda:0``: the shape pass (``profile``)
and the ``time profile`` then run CUDA kernels (synchronized around each timing); the other
phases are pure Python graph work and do not depend on the device.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fxpipe.capture._tracing import capture  # noqa: E402
from _results import header, write_json  # noqa: E402
from _device import add_device_argument, check_device, first_device, label  # noqa: E402
from fxpipe.emit._stages import emit_stages  # noqa: E402
from fxpipe.plan._op_graph import build_opgraph  # noqa: E402
from fxpipe.plan._partition import COMPUTE_OPS, partition  # noqa: E402
from fxpipe.plan._value import Plan  # noqa: E402
from fxpipe.plan._make import _fold_parameters  # noqa: E402  (the step of opgraph_for after build_opgraph)
from fxpipe.plan._profile import count_params_only, profile_graph  # noqa: E402

torch.set_num_threads(1)
N_STAGES = 8
SIZES = (250, 1000, 5000, 20000)


class DeepResMLP(nn.Module):
    def __init__(self, blocks: int, width: int = 8, skip: int = 16) -> None:
        super().__init__()
        self.skip = skip
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, layer in enumerate(self.layers):
            x = x + torch.relu(layer(x))
            if i >= self.skip:
                x = x + outs[i - self.skip]
            outs.append(x)
        return x


def blocks_for(nodes: int, skip: int = 16) -> int:
    """Blocks giving about ``nodes`` fx nodes (3 per block, 4 once skips start)."""
    return max(1, (nodes + skip) // 4)


def measure(target_nodes: int, time_profile: bool, dev: torch.device = torch.device("cpu")) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = DeepResMLP(blocks_for(target_nodes)).to(dev)
    x = torch.randn(2, 8, device=dev)
    args, kwargs = (x,), {}
    t: Dict[str, float] = {}
    gc.collect()

    t0 = time.perf_counter()
    captured = capture(model, args, kwargs)
    t["capture"] = time.perf_counter() - t0
    gm = captured.graph_module
    flat = pytree.tree_flatten((tuple(args), dict(kwargs)))[0]

    t0 = time.perf_counter()
    costs = count_params_only(gm, flat)
    t["profile"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    graph = build_opgraph(gm, costs)
    _fold_parameters(graph)
    for _, data in graph.nodes(data=True):
        data["memory"] = float(data.get("out_bytes") or 0) + 2.0 * float(data.get("params") or 0)
    t["opgraph"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    assignment = partition(graph, N_STAGES, cost_attr="params")
    t["partition"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    assignment_x = partition(graph, N_STAGES, cost_attr="params", seconds_per_byte=1.0)
    t["partition+xfer"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan = Plan.from_assignment(graph, assignment, balance_by="params", cost_attr="params")
    t["plan"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    stages = emit_stages(gm, plan)
    t["emit"] = time.perf_counter() - t0

    total = sum(t.values())
    timed = None
    if time_profile:
        t0 = time.perf_counter()
        profile_graph(gm, flat, device=dev)
        timed = time.perf_counter() - t0

    m = sum(1 for _, d in graph.nodes(data=True) if d.get("op") in COMPUTE_OPS)
    return {
        "target_nodes": target_nodes,
        "nodes": graph.number_of_nodes(),
        "compute_nodes": m,
        "blocks": len(model.layers),
        "seconds": t,
        "total_s": total,
        "time_profile_s": timed,
        "portals": len(plan.portals),
        "boundary_edges": len(plan.edges),
        "stages_emitted": len(stages),
        "xfer_plan_differs": assignment_x != assignment,
    }


PHASES = ["capture", "profile", "opgraph", "partition", "partition+xfer", "plan", "emit"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-nodes", type=int, default=20000, help="largest model size (fx nodes)")
    p.add_argument("--no-time-profile", action="store_true", help="skip the balance_by='time' profile column")
    p.add_argument("--quick", action="store_true", help="sizes up to 1000 nodes only")
    p.add_argument("--out", default=None, help="JSON (default results/planner_scaling[-cuda].json)")
    add_device_argument(p, "model and input on cuda:0; only the profile phases run kernels")
    a = p.parse_args(argv)
    check_device(a.device)
    dev = first_device(a.device)
    a.out = a.out or str(ROOT / "benchmarks" / "results" / f"planner_scaling{'' if a.device == 'cpu' else '-cuda'}.json")
    max_nodes = min(a.max_nodes, 1000) if a.quick else a.max_nodes
    sizes = [s for s in SIZES if s <= max_nodes] or [max_nodes]
    rows: List[Dict[str, Any]] = []
    began = time.perf_counter()
    measure(50, False, dev)  # warm-up: lazy imports and first-trace set-up are not billed to the first size
    for size in sizes:
        rows.append(measure(size, not a.no_time_profile, dev))
        print(f"# {size}: {rows[-1]['total_s']:.1f}s", file=sys.stderr)
    head = "| nodes | " + " | ".join(PHASES) + " | total | time profile | total / node |"
    print(head)
    print("|--:|" + "--:|" * (len(PHASES) + 3))
    for r in rows:
        cells = [f"{r['seconds'][ph]:.3f}" for ph in PHASES]
        tp = "-" if r["time_profile_s"] is None else f"{r['time_profile_s']:.2f}"
        print(f"| {r['nodes']} | " + " | ".join(cells) + f" | {r['total_s']:.2f} | {tp} | "
              f"{r['total_s'] / r['nodes'] * 1e6:.0f} µs |")
    result = {
        **header("planner_scaling", label(a.device)),
        "n_stages": N_STAGES,
        "seconds": time.perf_counter() - began,
        "rows": rows,
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
