"""The pieces of ``benchmarks/distributed.py``: its two models, the peer's two splits, the
peer built by hand, the per-rank busy-time recorder behind the bubble fraction, and the
replay that times one stage alone.

Kept apart so that each file has one job: this one knows models, splits and
torch.distributed.pipelining; the driver spawns the ranks and measures; ``_dist_report.py``
summarises.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline as torch_pipeline
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["Block", "Stack", "Funnel", "make_case", "cuts_of_plan", "equal_param_cuts", "Peer",
           "BusyRecorder", "stage_inputs", "stage_seconds"]


class Block(nn.Module):
    """Pre-norm residual MLP block (a transformer block without attention)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class Stack(nn.Module):
    """``n`` equal blocks of width ``d`` (hidden ``h``) and a linear head: the same-split model."""

    def __init__(self, n: int, d: int, h: int, out: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, h) for _ in range(n)])
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Funnel(nn.Module):
    """Uneven widths: narrow token-wise blocks on (B, T, d) -- most of the time, few parameters
    -- then a mean over the T tokens and a wide MLP head on (B, width) -- most of the
    parameters, little time (T times fewer rows). An equal-parameter split puts every token
    block on the first stage; a time-balanced one cuts among them."""

    def __init__(self, d: int, hidden: List[int], width: int, out: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, h) for h in hidden])
        self.head = nn.Sequential(nn.Linear(d, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                  nn.Linear(width, width), nn.GELU(), nn.Linear(width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=1))


def make_case(name: str, quick: bool) -> Tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, x, y) for ``'same_split'`` or ``'unbalanced'``; the same on every rank (seeded)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "same_split":
        d, h, n, batch = (64, 256, 4, 16) if quick else (256, 1024, 8, 64)
        return Stack(n, d, h, 16), torch.randn(batch, d, generator=g), torch.randn(batch, 16, generator=g)
    if name == "unbalanced":
        if quick:
            d, hidden, width, batch, tokens = 16, [32, 64, 32], 256, 16, 16
        else:
            d, hidden, width, batch, tokens = 64, [128, 256, 512, 256, 128, 64], 1024, 64, 32
        model = Funnel(d, hidden, width, 16)
        return model, torch.randn(batch, tokens, d, generator=g), torch.randn(batch, 16, generator=g)
    raise KeyError(name)


def cuts_of_plan(graph_module: torch.fx.GraphModule, assignment: Dict[str, int], n_stages: int) -> Dict[str, SplitPoint]:
    """fxpipe's plan as a torch ``split_spec``: each stage k > 0 starts *before* the module its
    first node calls. Refuses (ValueError) a plan SplitPoint cannot express: stages not
    contiguous in graph order, or a stage starting at a function call, not a module."""
    nodes = [n for n in graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    order = [assignment[n.name] for n in nodes]
    if order != sorted(order):
        raise ValueError(f"fxpipe's stages are not contiguous in graph order ({order}): no SplitPoint spec "
                         "gives the same split; use another model or pass split_points")
    spec: Dict[str, SplitPoint] = {}
    for k in range(1, n_stages):
        first = next(n for n in nodes if assignment[n.name] == k)
        if first.op != "call_module":
            raise ValueError(f"fxpipe's stage {k} starts at node {first.name!r} ({first.op}), not a module call: "
                             "SplitPoint cannot express that cut; use another model or pass split_points")
        spec[str(first.target)] = SplitPoint.BEGINNING
    return spec


def equal_param_cuts(model: nn.Module, n: int) -> Dict[str, SplitPoint]:
    """The peer's split (torch.distributed.pipelining has no balancer; its docs split by hand):
    cuts before leaf modules (definition order, = execution order for the models here) that
    minimise the largest stage's parameter count -- the best equal-parameter split at module
    boundaries, not PiPPy's greedy ``split_into_equal_size`` (which, cutting before the
    module that would pass total / n, can leave the first stage nearly empty)."""
    leaves = [(name, sum(p.numel() for p in m.parameters(recurse=False)))
              for name, m in model.named_modules() if name and not any(True for _ in m.children())]
    prefix = [0]
    for _, w in leaves:
        prefix.append(prefix[-1] + w)
    # best[k][i]: (largest stage, cuts) splitting leaves[:i] into k non-empty stages
    best: Dict[Tuple[int, int], Tuple[int, List[int]]] = {(1, i): (prefix[i], []) for i in range(1, len(leaves) + 1)}
    for k in range(2, n + 1):
        for i in range(k, len(leaves) + 1):
            best[k, i] = min((max(best[k - 1, j][0], prefix[i] - prefix[j]), best[k - 1, j][1] + [j])
                             for j in range(k - 1, i))
    return {leaves[j][0]: SplitPoint.BEGINNING for j in best[n, len(leaves)][1]}


class Peer:
    """torch.distributed.pipelining by hand: ``pipeline()`` + ``split_spec``, this rank's
    ``PipelineStage``s (``local``: their indices, as the schedule places them) around
    ``pipe.get_stage_module``, the given schedule class, the loss scaled by ``1/chunks`` with
    ``scale_grads=False`` (what fxpipe does, so losses and gradients match)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, spec: Dict[str, SplitPoint], chunks: int,
                 schedule_class: type, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], local: List[int],
                 n_stages: int, device: torch.device) -> None:
        ir = torch_pipeline(model, (x[: x.shape[0] // chunks],), split_spec=spec)
        if ir.num_stages != n_stages:
            raise ValueError(f"split {list(spec)} made {ir.num_stages} stages, not {n_stages}")
        # PipelineStage on each split module, as the torch docs' manual path does (build_stage's
        # _PipeStage warms up by sending to its neighbour ranks, itself at world size 1)
        self.stages = [PipelineStage(ir.get_stage_module(k), k, n_stages, device) for k in local]
        self.modules = [s.submod for s in self.stages]
        self.first, self.last = 0 in local, n_stages - 1 in local
        several = len(local) > 1
        self.schedule = schedule_class(self.stages if several else self.stages[0], chunks,
                                       loss_fn=lambda o, t: loss_fn(o, t) / chunks, scale_grads=False)

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return (item for m in self.modules for item in m.named_parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """One training step; the mini-batch loss on the last stage's rank, None elsewhere."""
        losses: List[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        return torch.stack([t.detach() for t in losses]).sum() if self.last else None


class BusyRecorder:
    """This rank's busy time: seconds spent inside ``forward_one_chunk``, ``backward_one_chunk``
    and ``backward_weight_one_chunk`` of any ``PipelineStage`` (both contenders' stages derive
    from ``_PipelineStageBase``) and in the schedules' ``_compute_loss`` (both use torch's
    schedules). Waiting for sends and receives happens in the schedule between those calls,
    so it is not counted.

    ``fxpipe.distributed.trace.record`` wraps the same methods but only on the stages of an
    fxpipe ``DistributedPipeline``; this one, on the class, sees the peer's stages too.
    Spans are ``(kind, start, end)`` on this rank's clock; the driver adds one ``step`` span
    per step."""

    #: (class, method, span kind as fxpipe.distributed.trace names it)
    METHODS = [(_PipelineStageBase, "forward_one_chunk", "forward"), (_PipelineStageBase, "backward_one_chunk", "backward"),
               (_PipelineStageBase, "backward_weight_one_chunk", "weight"), (_PipelineSchedule, "_compute_loss", "loss")]

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self.spans: List[Tuple[str, float, float]] = []
        self._sync = synchronize
        self._saved: Dict[str, Any] = {}

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.spans.append((label, t0, time.perf_counter()))
        return timed

    @contextmanager
    def installed(self) -> Iterator["BusyRecorder"]:
        for cls, m, kind in self.METHODS:
            self._saved[m] = getattr(cls, m)
            setattr(cls, m, self._wrap(kind, self._saved[m]))
        try:
            yield self
        finally:
            for cls, m, _ in self.METHODS:
                setattr(cls, m, self._saved.pop(m))


@contextmanager
def stage_inputs() -> Iterator[List[Tuple[nn.Module, List[Any]]]]:
    """Records (stage module, inputs) of every stage forward while installed: the
    micro-batch inputs :func:`stage_seconds` replays."""
    seen: List[Tuple[nn.Module, List[Any]]] = []
    original = _PipelineStageBase.forward_maybe_with_nosync

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((self.submod, [a.detach().clone().requires_grad_(a.requires_grad)
                                   if isinstance(a, torch.Tensor) else a for a in args]))
        return original(self, *args, **kwargs)

    _PipelineStageBase.forward_maybe_with_nosync = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        _PipelineStageBase.forward_maybe_with_nosync = original  # type: ignore[method-assign]


def stage_seconds(module: nn.Module, inputs: List[Any], repeats: int, synchronize: Callable[[], None]) -> float:
    """Minimum seconds of one stage's forward + backward on one micro-batch, run alone: the
    cost a balancer should equalise (the minimum, as fxpipe's profiler: other processes on
    the machine only add time). The backward starts from ones for every output that needs
    grad, the last stage's too (its loss, the same small function for every contender, is
    left out: the last stage's output is a tensor for the peer and flat leaves for fxpipe)."""
    times = []
    for _ in range(repeats):
        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in inputs]
        synchronize()
        t0 = time.perf_counter()
        out = module(*args)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)