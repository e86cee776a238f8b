"""The build check's run of the first micro-batch, recorded for the plan: a profile without a
run of its own.

Why: a plan is profiled on the sample's first micro-batch (:func:`fxpipe.plan._make.profiled_inputs`),
and a 'time' plan ran the captured graph on it to give every node its inputs -- 0.45 s of GPT-2
124M's build, a sixth of an eager training step (issue 31) -- right after the build's micro-batch
check (:mod:`fxpipe.checks._one_pass`) had run the same graph on the same micro-batch. The check
now runs that micro-batch through a :class:`RecordedRun`, which keeps what the plan needs: each
node's output bytes and shape, its cost key (:mod:`fxpipe.plan._cost_keys`), and, for the first
node of each key, its inputs and the seconds of its forward. :func:`profile_recorded` times those
nodes afterwards as :func:`~fxpipe.plan._profile.profile_graph` would have.

What differs from a run of its own: the check computes at nudged weights, with draws made constant,
in the mode it checks first (eval, for a graph that follows modes). Sizes do not depend on them;
the timings run after the check, in the model's own mode, on the kept inputs (the weights a node
reads are the model's own again by then). Which nodes count as copies of one another is decided
by the keys of the check's mode. A record is used only where the check's micro-batch is the
plan's (not a padded or varied copy of the sample the check ran instead) and its run finished;
otherwise the profile runs the graph as before. Kept inputs hold one activation per distinct
node of one micro-batch until the plan is made.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import fx

from ..capture._grad_regions import RegionInterpreter
from ._cost_keys import cost_key
from ._partition import COMPUTE_OPS
from ._profile import NodeCost, _param_bytes, _param_count, _state_kept, _Timer, cuda_device_of, shape_str, tensor_bytes

__all__ = ["RecordedRun", "profile_recorded"]


class RecordedRun(RegionInterpreter):
    """Called as the graph is (``record(*flat)``, the graph's flat outputs), recording what a
    plan needs (see the module docstring). ``timed``: keep the inputs for a 'time' plan;
    without, sizes only."""

    def __init__(self, gm: fx.GraphModule, timed: bool) -> None:
        super().__init__(gm)
        self.timed = timed
        #: the inputs of the finished run (None until one finished)
        self.inputs: Optional[List[Any]] = None
        self.sizes: Dict[str, Tuple[int, str]] = {}  # node -> (output bytes, shape)
        self.keys: Dict[str, Optional[Hashable]] = {}  # compute node -> cost key
        self.kept: Dict[str, Tuple[tuple, dict, float]] = {}  # first of its key -> (args, kwargs, forward s)
        self._seen: set = set()  # keys met

    def __call__(self, *flat: Any) -> Any:
        self.inputs = None
        self.sizes, self.keys, self.kept, self._seen = {}, {}, {}, set()
        out = self.run(*flat)
        self.inputs = list(flat)
        return out

    def run_node(self, n: fx.Node) -> Any:
        if not (self.timed and n.op in COMPUTE_OPS):
            out = super().run_node(n)
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = cost_key(self.module, n, args, kwargs)
            start = time.perf_counter()
            out = super().run_node(n)
            forward = time.perf_counter() - start
            if key is None or key not in self._seen:
                self.kept[n.name] = (args, kwargs, forward)
                self._seen.add(key)
            self.keys[n.name] = key
        self.sizes[n.name] = (tensor_bytes(out), shape_str(out))
        return out

    def ran_on(self, flat: Sequence[Any]) -> bool:
        """Whether a run finished on exactly ``flat`` (the plan's inputs)."""
        if self.inputs is None or len(self.inputs) != len(flat):
            return False
        for a, b in zip(self.inputs, flat):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                        and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)):
                    return False
            elif a is not b and a != b:
                return False
        return True


def profile_recorded(record: RecordedRun, *, repeat: int = 3,
                     on_node: Optional[Callable[[], None]] = None) -> Dict[str, NodeCost]:
    """What :func:`~fxpipe.plan._profile.profile_graph` gives on the recorded run's inputs
    (``record.timed``; otherwise the times are 0, as :func:`count_params_only`'s), from the
    record: the distinct nodes timed on their kept inputs, their copies given those times."""
    gm: fx.GraphModule = record.module  # type: ignore[assignment]
    assert record.inputs is not None, "profile_recorded needs a finished run"
    timer = _Timer(RegionInterpreter(gm), repeat, cuda_device_of(gm, record.inputs))
    costs: Dict[str, NodeCost] = {}
    with _state_kept(gm):
        for n in gm.graph.nodes:
            seconds, source = 0.0, ""
            if record.timed and n.op in COMPUTE_OPS:
                key = record.keys[n.name]
                if n.name in record.kept:
                    args, kwargs, forward = record.kept[n.name]
                    seconds = timer.seconds(n, args, kwargs, forward, key)
                else:
                    source, seconds = timer.reused(key) or ("", 0.0)
            out_bytes, shape = record.sizes[n.name]
            costs[n.name] = NodeCost(seconds, _param_count(gm, n), out_bytes, _param_bytes(gm, n), shape, source)
            if on_node is not None:
                on_node()
    return costs
