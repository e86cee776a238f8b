"""The stages' boundary metadata at a new shape read from the graph itself, for torch.export captures.

A torch.export capture declares every dim ``Dim.AUTO`` (:mod:`fxpipe.capture._export`) and
leaves on every node of its graph the fake of its value, whose sizes are expressions in the
symbols of the inputs' sizes (``meta['val']``); the emitted stages keep those nodes, portals and
carried values included. Each value crossing a stage boundary therefore has its shape written
down already: a new shape's ``PipelineStage`` metadata is those expressions evaluated at the
call's sizes -- no stage is run, not even on fakes (the fake runs of :mod:`._symbolic_meta` cost
seconds at a model's first new length: 11x a GPT-2 step on two busy CPU ranks, issue 31).

What the expressions do not say is taken from the build's fake run of the stages at the
sample's shape (the template): dtypes, ``requires_grad`` (export's fakes carry no autograd
state), the kinds and constants of non-tensor values. None of these depends on the sizes where
the export's guards hold: the graph is one program there (torch.export's contract), and each
call's sizes are checked against those guards before it runs
(:meth:`fxpipe.capture._tracing.Capture.check_micro_batches`). The guards leave the split dim
out -- a micro-batch of one sample is split off any batch -- so a size below a symbol's range
(export treats 0 and 1 apart) is left to a fake run here, as are inputs whose dtype or
``requires_grad`` differs from the template's. The reading is checked once, at the build: the
expressions evaluated at the sample's sizes must give every shape the fake run gave, else (a
graph without the values, an fx capture) this route is not taken at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx

from fxpipe.capture._shape_guards import bound, size_expr

from ._meta import Runs

__all__ = ["GraphMetas", "evaluated_size", "meta_like"]


@dataclass
class GraphMetas:
    """Every stage's outputs as symbolic values of the export graph, evaluated per shape."""

    template: Runs
    #: stage 0's placeholders' values (the model's flat inputs)
    inputs: list[Any]
    #: per stage, its outputs' values: a node's ``meta['val']``, or the constant the stage returns
    outputs: list[list[Any]]
    #: each symbol's (least, greatest or None) value
    ranges: dict[Any, tuple[int, Optional[int]]]

    @classmethod
    def of(cls, stages: Sequence[torch.fx.GraphModule], template: Runs,
           micro_flat: Sequence[Any]) -> Optional["GraphMetas"]:
        """The reading of ``stages``' graphs, or None when they do not carry symbolic values
        that reproduce ``template`` (the fake run at ``micro_flat``, the build's shape)."""
        try:
            phs = [n for n in stages[0].graph.nodes if n.op == "placeholder"]
            outputs = [[_val(a) for a in _output_args(stage)] for stage in stages]
        except (LookupError, TypeError):
            return None
        if len(phs) != len(micro_flat) or any(len(o) != len(outs) for o, (_, outs) in zip(outputs, template)):
            return None
        inputs = [n.meta.get("val") for n in phs]
        env = next((v.fake_mode.shape_env for v in inputs if isinstance(v, torch.Tensor)
                    and getattr(v, "fake_mode", None) is not None), None)
        if env is None:
            return None
        ranges = {sym: (bound(vr.lower) or 0, bound(vr.upper)) for sym, vr in env.var_to_range.items()}
        reading = cls(template, inputs, outputs, ranges)
        return reading if _same_shapes(reading.at(micro_flat), template) else None

    def at(self, micro_flat: Sequence[Any]) -> Optional[Runs]:
        """Each stage's inputs and outputs at ``micro_flat``'s sizes (meta tensors with the
        template's dtypes and ``requires_grad``); None where the reading does not cover that
        shape (the caller runs fakes)."""
        bindings = self._bindings(micro_flat)
        if bindings is None:
            return None
        try:
            values = [meta_like(x, x.shape) if isinstance(x, torch.Tensor) else x for x in micro_flat]
            runs: Runs = []
            for vals, (_, outs) in zip(self.outputs, self.template):
                out = [_evaluated(v, t, bindings) for v, t in zip(vals, outs)]
                runs.append((values, out))
                values = out
        except (TypeError, ValueError):  # a size the input sizes do not determine (data-dependent)
            return None
        return runs

    def _bindings(self, micro_flat: Sequence[Any]) -> Optional[dict[Any, Any]]:
        """Each input size's symbol bound to the call's size; None where an input differs from
        the template in kind, dims, dtype or ``requires_grad``, or a size falls outside what
        its symbol stands for."""
        bindings: dict[Any, Any] = {}
        derived: list[tuple[Any, int]] = []
        for x, val, t in zip(micro_flat, self.inputs, self.template[0][0]):
            if not isinstance(x, torch.Tensor):
                continue
            if not isinstance(val, torch.Tensor) or not isinstance(t, torch.Tensor) or val.dim() != x.dim() \
                    or (x.dtype, x.requires_grad) != (t.dtype, t.requires_grad):
                return None
            for n, size in zip(val.shape, x.shape):
                expr = size_expr(n)
                if isinstance(expr, int) or getattr(expr, "is_number", False):
                    if int(expr) != size:
                        return None
                elif expr.is_Symbol:
                    lo, hi = self.ranges.get(expr, (2, None))
                    if size < lo or (hi is not None and size > hi) or bindings.setdefault(expr, size) != size:
                        return None
                else:
                    derived.append((expr, int(size)))
        for expr, size in derived:
            value = expr.xreplace({k: sympy.Integer(v) for k, v in bindings.items()})
            if not value.is_number or int(value) != size:
                return None
        return {k: sympy.Integer(v) for k, v in bindings.items()}


def _output_args(stage: torch.fx.GraphModule) -> list[Any]:
    """The values a stage returns, as its graph's output node lists them."""
    out = next(n for n in stage.graph.nodes if n.op == "output")
    args = out.args[0]
    if not isinstance(args, (tuple, list)):
        raise TypeError("a stage returning one value")
    return list(args)


def _val(arg: Any) -> Any:
    """A node's recorded value (its fake, a SymInt), a container's item by item, a constant as it is."""
    if isinstance(arg, torch.fx.Node):
        if "val" not in arg.meta:
            raise LookupError(arg.name)
        return arg.meta["val"]
    if type(arg) in (tuple, list):
        return type(arg)(_val(a) for a in arg)
    return arg


def meta_like(template: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A meta tensor of ``shape`` with ``template``'s dtype and ``requires_grad``."""
    return torch.empty(tuple(shape), dtype=template.dtype, device="meta").requires_grad_(template.requires_grad)


def evaluated_size(n: Any, bindings: dict[Any, Any]) -> int:
    """A size at ``bindings``: a SymInt's expression evaluated, an int as it is (TypeError if a
    symbol is left: a size the inputs' sizes do not determine)."""
    expr = size_expr(n)
    if isinstance(expr, int):
        return expr
    value = expr.xreplace(bindings)
    if not value.is_number:
        raise TypeError(f"size {expr} is not determined by the inputs' sizes")
    return int(value)


def _evaluated(val: Any, template: Any, bindings: dict[Any, Any]) -> Any:
    """The value a stage returns at ``bindings``: the recorded value's sizes evaluated, the
    template's dtype, ``requires_grad``, kind and constants."""
    if isinstance(val, (torch.SymBool, torch.SymFloat)):  # a number the sizes decide, not a size
        raise TypeError("a symbolic bool or float crosses a stage boundary")
    if isinstance(template, torch.Tensor):
        if not isinstance(val, torch.Tensor) or val.dim() != template.dim():
            raise TypeError("a tensor the graph did not record as one")
        return meta_like(template, [evaluated_size(n, bindings) for n in val.shape])
    if isinstance(template, bool) or not isinstance(template, int):
        if type(template) in (tuple, list):
            if type(val) not in (tuple, list) or len(val) != len(template):
                raise TypeError("a container the graph did not record as one")
            return type(template)(_evaluated(v, t, bindings) for v, t in zip(val, template))
        if isinstance(template, torch.Size):
            return torch.Size([evaluated_size(n, bindings) for n in val])
        return template
    if isinstance(val, (int, torch.SymInt)):
        return evaluated_size(val, bindings)
    raise TypeError("an int the graph did not record as one")


def _same_shapes(runs: Optional[Runs], template: Runs) -> bool:
    """Whether ``runs`` has every shape and int ``template`` has."""
    if runs is None or len(runs) != len(template):
        return False
    return all(_same(a, b) for (_, outs), (_, want) in zip(runs, template) for a, b in zip(outs, want))


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
    if type(b) in (tuple, list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
