"""The stages' boundary metadata for every shape from one fake run over symbolic sizes.

Each new micro-batch shape needs its ``PipelineStage`` metadata (:mod:`._shape_runs`). A fake
run of every stage (:func:`fxpipe.distributed._meta.stage_metas`) costs about 1 ms per graph
node -- 0.8 s on two busy CPU ranks for a 4-layer Llama, several times its step. So at the
first new shape (the build's own has its fake run) the stages run once more under a
``FakeTensorMode`` with a ``ShapeEnv``, every size of every input a symbol of its own
(:func:`fxpipe.capture._shape_guards.symbolic_inputs`). Every value crossing a stage boundary
then has its shape as an expression in those symbols, and each later shape's metadata is
those expressions evaluated at its sizes.

What the symbolic run assumed is checked per shape and per stage (:meth:`SymbolicMetas.at`):
a size it fixed that differs, or a size below a symbol's range (sizes of 1: a micro-batch of
one sample), leaves the whole shape to a fake run of its own; a guard a stage's run recorded
(a branch on a size, an equality the ops needed, a replacement of one symbol by another, a
pad that fixed the labels' size) that fails at the new sizes, or an expression left with a
symbol, leaves that stage and the ones after it to a fake run from the last evaluated stage's
outputs. Metadata from here equals the fake run's (``tests/distributed/test_symbolic_meta.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.capture._shape_guards import bound, symbolic_inputs

from ._graph_meta import GraphMetas, evaluated_size, meta_like
from ._meta import (Runs, StageMeta, fake_of, fake_runs, metas_of, on_device, stage_metas, stage_runs, uncompiled,
                    unhooked)

__all__ = ["SymbolicMetas", "ShapeMetas"]


@dataclass
class SymbolicMetas:
    """One symbolic fake run of the stages, evaluated per shape."""

    runs: Runs
    #: per flat input index: each dim's symbol, or the int the run fixed
    slots: dict[int, list[Any]]
    #: per stage, what the run relied on up to its end (guards, runtime asserts, replacements)
    conditions: list[list[Any]]
    ranges: dict[Any, tuple[int, Optional[int]]]
    stages: Sequence[torch.fx.GraphModule]
    input_names: Sequence[Sequence[str]]
    device: torch.device

    @classmethod
    def trace(cls, stages: Sequence[torch.fx.GraphModule], micro_flat: Sequence[Any],
              input_names: Sequence[Sequence[str]], device: torch.device) -> Optional["SymbolicMetas"]:
        """The symbolic run, or None when the stages cannot run symbolically (every shape then
        has its own fake run)."""
        runs: Runs = []
        conditions: list[list[Any]] = []
        try:
            mode, values, slots = symbolic_inputs(micro_flat, device)
            env = mode.shape_env
            # each symbol's range as made (at least 2); what a stage narrows is in its conditions
            ranges = {sym: (bound(vr.lower) or 0, bound(vr.upper)) for sym, vr in env.var_to_range.items()}
            with mode, on_device(stages, device), uncompiled(stages):
                for stage in stages:
                    out = list(unhooked(stage)(*values))
                    runs.append((values, out))
                    values = out
                    conditions.append([g.expr for g in env.guards]
                                      + [a.expr for asserts in env.deferred_runtime_asserts.values() for a in asserts]
                                      + [sympy.Eq(sym, expr) for sym, expr in env.replacements.items()])
        except Exception:  # noqa: BLE001 - a stage that needs concrete sizes: a fake run per shape
            return None
        return cls(runs, slots, conditions, ranges, stages, input_names, device)

    def at(self, micro_flat: Sequence[Any]) -> Optional[list[StageMeta]]:
        """The metadata at ``micro_flat``'s sizes: each stage whose run's conditions hold there
        evaluated, the stages from the first that does not run on fakes of that shape (a pad
        or a loss that fixed a size: often the last stage alone); None when the first stage's
        do not hold (the caller runs every stage on fakes)."""
        bindings: dict[Any, Any] = {}
        for i, dims in self.slots.items():
            x = micro_flat[i]
            if not isinstance(x, torch.Tensor) or x.dim() != len(dims):
                return None
            for want, size in zip(dims, x.shape):
                if isinstance(want, int):
                    if want != size:
                        return None
                    continue
                lo, hi = self.ranges.get(want, (2, None))
                if size < lo or (hi is not None and size > hi):
                    return None
                bindings[want] = sympy.Integer(int(size))
        runs: Runs = []
        try:
            for (ins, outs), conditions in zip(self.runs, self.conditions):
                if not all(bool(c.xreplace(bindings)) for c in conditions):
                    break
                runs.append(([_concrete(v, bindings) for v in ins], [_concrete(v, bindings) for v in outs]))
        except (TypeError, ValueError):  # an expression left with a symbol: from that stage on, fakes
            pass
        if not runs:
            return None
        if len(runs) < len(self.runs):  # the rest on fakes, from the last evaluated stage's outputs
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                values = [fake_of(v, self.device) if isinstance(v, torch.Tensor) else v for v in runs[-1][1]]
                runs += fake_runs(self.stages[len(runs):], values, self.device, mode)
        return metas_of(runs, self.input_names)


class ShapeMetas:
    """Metadata per micro-batch shape for one set of stages: the build's shape by a fake run, each
    later one read from a torch.export graph's symbolic values (:mod:`._graph_meta`), else from
    the symbolic run (made at the first new shape, so that a pipeline that keeps its shape pays
    nothing more), or by a fake run of its own where neither covers it."""

    def __init__(self, stages: Sequence[torch.fx.GraphModule], input_names: Sequence[Sequence[str]],
                 device: torch.device) -> None:
        self.stages, self.input_names, self.device = stages, input_names, device
        self._graph: Optional[GraphMetas] = None
        self._symbolic: Optional[SymbolicMetas] = None
        self._first = True
        #: shapes whose metadata was read from the graph, evaluated from the symbolic run, and
        #: made by a fake run of their own
        self.read = self.evaluated = self.fake_runs = 0

    def __call__(self, micro_flat: Sequence[Any]) -> list[StageMeta]:
        # the metadata is made once per shape and kept for step() too: its requires_grad must be
        # training's, also when eval_step (under no_grad) brings the shape first (else the shape's
        # receive buffers, and the symbolic run's every later shape, took no gradient: measured,
        # "grad can be implicitly created only for scalar outputs" at the next step)
        with torch.enable_grad():
            return self._metas(micro_flat)

    def _metas(self, micro_flat: Sequence[Any]) -> list[StageMeta]:
        if self._first:  # the build's shape: the fake run, and the template of the graph's reading
            self._first = False
            self.fake_runs += 1
            runs = stage_runs(self.stages, micro_flat, self.device)
            self._graph = GraphMetas.of(self.stages, runs, micro_flat)
            return metas_of(runs, self.input_names)
        read = self._graph.at(micro_flat) if self._graph is not None else None
        if read is not None:
            self.read += 1
            return metas_of(read, self.input_names)
        if self._symbolic is None:
            self._symbolic = SymbolicMetas.trace(self.stages, micro_flat, self.input_names, self.device) \
                or _NOT_SYMBOLIC
        metas = self._symbolic.at(micro_flat) if isinstance(self._symbolic, SymbolicMetas) else None
        if metas is not None:
            self.evaluated += 1
            return metas
        self.fake_runs += 1
        return stage_metas(self.stages, micro_flat, self.input_names, self.device)


_NOT_SYMBOLIC: Any = object()  # the stages could not run symbolically: a fake run per shape


def _concrete(value: Any, bindings: dict[Any, Any]) -> Any:
    """A value of the symbolic run at ``bindings``: a tensor as a meta tensor of that shape (its
    dtype and ``requires_grad``), sizes and ints evaluated, containers item by item."""
    if isinstance(value, torch.Tensor):
        return meta_like(value, [evaluated_size(n, bindings) for n in value.shape])
    if isinstance(value, torch.Size):
        return torch.Size([evaluated_size(n, bindings) for n in value])
    if isinstance(value, torch.SymInt):
        return evaluated_size(value, bindings)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise TypeError("a symbolic float or bool crosses a stage boundary")
    if type(value) in (tuple, list):
        return type(value)(_concrete(v, bindings) for v in value)
    return value
