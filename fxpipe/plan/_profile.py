"""Per-node cost of a captured graph: time (forward + backward), activation and parameter bytes.

Why per node and on real inputs: the partitioner balances stages by the *sum* of node
costs, so each node is timed in isolation with the tensors it really receives on the sample
(an fx Interpreter runs the graph once and feeds every node its actual inputs). Backward is
timed with ``torch.autograd.grad`` so nothing accumulates into the model's ``.grad``; buffers
(BatchNorm running stats) and the RNG state are restored afterwards, so profiling leaves
the model exactly as it found it.

Why once per distinct node: a transformer is N copies of one block. Nodes with the same
:func:`~fxpipe.plan._cost_keys.cost_key` (same module class and code, parameter layouts, input
shapes) are timed once; the copies reuse that time and record which node it came from
(``NodeCost.reused_from``), so a plan can say which of its costs were measured. There is no
whole-model warm-up run: every distinct node is timed at least twice (the fastest counts),
so one-time set-up billed to a first run does not count; a node whose forward, run just
before, took 25 ms or more is timed once (its set-up was paid by that forward, and is small
beside it).
"""

from __future__ import annotations

import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ._cost_keys import cost_key
from ..capture._grad_regions import REGION, RegionInterpreter, entered
from ._partition import COMPUTE_OPS
from ._traced_sizes import traced_sizes
from ..runtime._randomness import generator_states, set_generator_states
from ..runtime._stream import synchronize

__all__ = ["NodeCost", "profile_graph", "count_params_only", "tensor_bytes", "shape_str", "cuda_device_of"]

# a node is re-run only while its runs so far took less than this (a single slow, e.g.
# pre-empted, run still gets company); a node whose forward alone took a quarter of it runs once
_NODE_BUDGET_S = 0.1
# after this long, remaining nodes are timed once: keeps big models' profiles to seconds
_TOTAL_BUDGET_S = 10.0


@dataclass(frozen=True)
class NodeCost:
    """What one graph node costs: ``seconds`` of forward + backward, measured by
    :func:`profile_graph` (0.0 from :func:`count_params_only`, which times nothing), and the
    number and bytes of the parameters it owns, the bytes of its output and its shape.
    ``reused_from`` names the node whose measurement ``seconds`` is ('' when this node was
    timed itself, or nothing was timed)."""

    seconds: float
    param_count: int
    out_bytes: int
    param_bytes: int
    shape: str
    reused_from: str = ""


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in ``value`` (nested tuples/lists/dicts); 0 for symbolic sizes."""
    total = 0
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            try:
                total += int(t.numel()) * t.element_size()
            except Exception:  # noqa: BLE001 - fake tensor with an unbacked symbolic size
                pass
    return total


def shape_str(value: Any) -> str:
    """``8x3x32x32`` for a tensor, ``(8x16, 8x16)`` for a tuple, ``()`` for a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return "x".join(str(s) for s in value.shape) or "()"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(shape_str(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shape_str(v)}" for k, v in value.items()) + "}"
    return "None" if value is None else type(value).__name__


def _param_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    """Bytes of a call_module's parameters and buffers, or of a get_attr's tensor."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return tensor_bytes(list(mod.parameters()) + list(mod.buffers()))
    if node.op == "get_attr":
        return tensor_bytes(attrgetter(node.target)(gm))
    return 0


def _param_count(gm: fx.GraphModule, node: fx.Node) -> float:
    """Number of parameters a node owns (its module's, or the Parameter it fetches)."""
    if node.op == "call_module":
        return float(sum(p.numel() for p in gm.get_submodule(node.target).parameters()))
    if node.op == "get_attr":
        obj = attrgetter(node.target)(gm)
        return float(obj.numel()) if isinstance(obj, torch.nn.Parameter) else 0.0
    return 0.0


def _mutates(n: fx.Node) -> bool:
    """Whether the node may write to its arguments: an op whose schema says so (an export
    graph's aten ops), an in-place function or method (``clamp_``, ``operator.iadd``), a
    call with ``inplace=True``, or a module (whose arguments are activations, copied anyway)."""
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return (n.op == "call_module" or (name.endswith("_") and not name.endswith("__"))
            or (name.startswith("i") and getattr(operator, name, None) is n.target) or bool(n.kwargs.get("inplace")))


def _time_fwd_bwd(run: Callable[..., Any], args: tuple, kwargs: dict, params: Sequence[torch.Tensor],
                  repeat: int, device: torch.device | None, shared: bool = False, grad: bool = True) -> float:
    """Seconds of forward + backward of one node (``grad=False``: the forward alone, for a node
    that cannot backward).

    The minimum over repeats: interference from other work only ever adds time, so the
    fastest run is the best estimate of the node's own cost (medians followed load spikes).
    ``shared``: the node writes to no argument, so a Parameter it takes is passed as a leaf of
    its own sharing the weight's storage, not a copy (GPT-2's head: 154 MB a run); one that
    writes (``weight.clamp_(min=0)``, a constraint) gets copies, the model's weights untouched.
    """
    times: list[float] = []
    for _ in range(max(1, repeat)):
        leaves: list[torch.Tensor] = []

        def prep(t: Any) -> Any:  # fresh non-leaf copy: in-place ops are safe, grads go to `leaves`
            if shared and isinstance(t, torch.nn.Parameter):  # a weight an export graph's op takes
                leaf = t.detach().requires_grad_(t.requires_grad)
                leaves.append(leaf)
                return leaf
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                leaf = t.detach().requires_grad_()
                leaves.append(leaf)
                return leaf.clone()
            return t.detach().clone() if isinstance(t, torch.Tensor) else t

        a, k = pytree.tree_map(prep, (args, kwargs))
        wrt = leaves + [p for p in params if p.requires_grad]
        synchronize(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = run(*a, **k)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= min(2, repeat) and sum(times) > _NODE_BUDGET_S:
            break
    return max(min(times), 1e-9)


class _Timer:
    """Forward + backward seconds of nodes on the inputs they are given, once per cost key
    (copies reuse the first one's), each call in the node's grad-mode / autocast region."""

    def __init__(self, interpreter: fx.Interpreter, repeat: int, device: torch.device | None) -> None:
        self.interpreter, self.repeat, self.device = interpreter, repeat, device
        self.measured: dict[Any, tuple[str, float]] = {}  # cost key -> (node timed, seconds)
        self.deadline = time.perf_counter() + _TOTAL_BUDGET_S

    def reused(self, key: Any) -> tuple[str, float] | None:
        """(the node measured, its seconds) for a key measured already, else None."""
        return self.measured.get(key) if key is not None else None

    def seconds(self, n: fx.Node, args: tuple, kwargs: dict, forward: float, key: Any) -> float:
        """``n``'s seconds on ``args``/``kwargs``. ``forward``: the seconds of the node's forward
        just run; one that took a quarter of :data:`_NODE_BUDGET_S` is timed once (its one-time
        costs were paid by that run, and a second run of GPT-2's head cost 0.16 s, a sixteenth
        of its eager step)."""
        params: list[torch.Tensor] = []
        if n.op == "call_module":
            params = list(self.interpreter.module.get_submodule(n.target).parameters())
        run = getattr(self.interpreter, n.op)
        region = n.meta.get(REGION)

        def call(*a: Any, **k: Any) -> Any:
            if not region:
                return run(n.target, a, k)
            with entered(region):
                return run(n.target, a, k)

        slow = forward >= _NODE_BUDGET_S / 4 or time.perf_counter() >= self.deadline
        repeat = 1 if slow else max(2, self.repeat)
        try:
            seconds = _time_fwd_bwd(call, args, kwargs, params, repeat, self.device, shared=not _mutates(n))
        except RuntimeError:  # e.g. an op without a derivative, an in-place op on a weight: the forward alone
            seconds = _time_fwd_bwd(call, args, kwargs, [], repeat, self.device, grad=False)
        if key is not None:
            self.measured[key] = (n.name, seconds)
        return seconds


class _Profiler(RegionInterpreter):
    def __init__(self, gm: fx.GraphModule, repeat: int, device: torch.device | None, timed: bool,
                 on_node: Callable[[], None] | None = None) -> None:
        super().__init__(gm)
        self.timer = _Timer(self, repeat, device) if timed else None
        self.costs: dict[str, NodeCost] = {}
        self.on_node = on_node

    def run_node(self, n: fx.Node) -> Any:
        start = time.perf_counter()
        out = super().run_node(n)
        forward = time.perf_counter() - start  # untimed, but a node this slow is timed once
        seconds, source = 0.0, ""
        if self.timer is not None and n.op in COMPUTE_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = cost_key(self.module, n, args, kwargs)
            source, seconds = self.timer.reused(key) or ("", self.timer.seconds(n, args, kwargs, forward, key))
        self.costs[n.name] = NodeCost(seconds, _param_count(self.module, n), tensor_bytes(out),
                                      _param_bytes(self.module, n), shape_str(out), source)
        if self.on_node is not None:
            self.on_node()
        return out


def cuda_device_of(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device the graph computes on, if any: its first CUDA input or parameter.

    Timings must synchronize it: CUDA kernels run asynchronously, so an unsynchronized
    timing measures the launch, not the work, and a 'time' balance would follow launch counts.
    """
    for t in (*flat_inputs, *gm.parameters(), *gm.buffers()):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def _run(gm: fx.GraphModule, flat_inputs: Sequence[Any], repeat: int, device: torch.device | str | None,
         timed: bool, on_node: Callable[[], None] | None = None) -> dict[str, NodeCost]:
    if device is not None:
        dev: torch.device | None = torch.device(device)
    else:
        dev = cuda_device_of(gm, flat_inputs) if timed else None
    inputs = [x.to(dev) if dev is not None and isinstance(x, torch.Tensor) else x for x in flat_inputs]
    prof = _Profiler(gm, repeat, dev, timed, on_node)
    with _state_kept(gm), torch.no_grad():
        prof.run(*inputs)
    return prof.costs


@contextmanager
def _state_kept(gm: fx.GraphModule) -> Iterator[None]:
    """BatchNorm statistics and randomness left as they were by the runs inside."""
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    rng = generator_states()
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                if name in buffers:
                    b.data.copy_(buffers[name])  # .data: no version bump (see prepare.preserved)
        set_generator_states(rng)


def profile_graph(gm: fx.GraphModule, flat_inputs: Sequence[Any], *, repeat: int = 3,
                  device: torch.device | str | None = None,
                  on_node: Callable[[], None] | None = None) -> dict[str, NodeCost]:
    """Time every distinct compute node of ``gm`` (forward + backward, the fastest of 2 to
    ``repeat`` runs, one run for a node whose forward took 25 ms); copies of a timed node
    reuse its time (``NodeCost.reused_from``).

    ``flat_inputs`` are the graph's placeholders' values (``Capture.flatten_inputs``). With
    ``device`` the inputs are moved there and CUDA is synchronised around each timing; the
    graph's parameters must already live on that device. Without it, a graph whose inputs or
    parameters are on a GPU is synchronised on that GPU. Non-compute nodes cost 0.
    ``on_node`` is called after each node (a progress bar's step).
    """
    return _run(gm, flat_inputs, repeat, device, timed=True, on_node=on_node)


def count_params_only(gm: fx.GraphModule, flat_inputs: Sequence[Any] | None = None, *,
                      on_node: Callable[[], None] | None = None) -> dict[str, NodeCost]:
    """Deterministic costs for ``balance_by='params'``: parameter counts and bytes, no timing.

    call_module nodes own their module's parameters, get_attr nodes the Parameter they
    fetch. With ``flat_inputs``, ``out_bytes`` and ``shape`` are those on the inputs: read from
    an export graph's traced values at the inputs' sizes (:mod:`fxpipe.plan._traced_sizes`), else
    from one untimed run; without, from ``node.meta['val']`` (export graphs) or 0 / ''.
    """
    if flat_inputs is not None:
        outputs = traced_sizes(gm, flat_inputs)
        if outputs is None:
            return _run(gm, flat_inputs, 1, None, timed=False, on_node=on_node)
        sized: dict[str, NodeCost] = {}
        for n in gm.graph.nodes:
            out = outputs[n.name]
            sized[n.name] = NodeCost(0.0, _param_count(gm, n), tensor_bytes(out), _param_bytes(gm, n), shape_str(out))
            if on_node is not None:
                on_node()
        return sized
    costs: dict[str, NodeCost] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        costs[n.name] = NodeCost(0.0, _param_count(gm, n), tensor_bytes(val) if val is not None else 0,
                                 _param_bytes(gm, n), shape_str(val) if val is not None else "")
    return costs
