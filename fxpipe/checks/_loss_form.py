"""What a loss counts: read off its aten graph as a sum over samples, or a ratio of such sums.

Splitting a batch into micro-batches gives one loss ``L_i`` per micro-batch; the step needs
weights ``w_i`` with ``sum_i w_i L_i`` equal to the loss of the whole batch, in value and in
every gradient. Which weights, if any, depends on what the loss divides by, and that is a
property of its code *and* of the data: a token mean with a pad id, a masked mean
``(l * mask).sum() / mask.sum()``, a class-weighted cross entropy all divide by a number the
data decide. So the loss is not trusted; its graph is read, per op, with an abstract value per
node (:class:`Form`):

* ``rows``: a tensor whose slices along one dim each belong to one sample (the output, the
  target, anything computed from them sample by sample: pointwise ops, views that keep the
  samples in one dim, reductions over other dims, a cross entropy with ``reduction='none'``);
* ``total``: a sum over the samples of per-sample values (``sum`` over the samples' dim, a
  loss op with ``reduction='sum'``), combined only linearly afterwards;
* ``ratio``: a ``total`` that carries the gradient divided by a count: a ``total`` computed
  from the data alone (``mask.sum()``, a cross entropy's total weight: its labels that are not
  ``ignore_index``, weighted by the class weights of the targets), or a number proportional
  to the number of samples (a mean over the samples' dim, ``/ out.size(0)``);
* ``free``: depends on no sample (constants, class weights, sizes of other dims);
* ``bad``: anything else, with the reason: an op that mixes the samples (``out @ out.T`` of
  an in-batch-negatives loss, a softmax or a max over the samples, indexing one sample), a
  nonlinear function of a sum, or an op this reading does not know.

A loss of form ``total`` merges by ``sum_i L_i``; one of form ``ratio`` by
``sum_i D_i L_i / sum_i D_i`` with ``D_i`` the count evaluated on micro-batch ``i`` (its
program is copied out of the graph, :func:`fxpipe.checks._loss_den.den_program`). That is the whole batch's sum over
its whole count, exactly. Anything else is not proven, and the caller computes the loss on
the merged output or refuses (:mod:`fxpipe.checks._loss_fn`).

Numbers derived from the batch size are told apart from literals by comparing traces at
several batch sizes (:func:`fxpipe.checks._loss_traces.count_args`): ``/ out.size(0)`` differs
between them, ``/ 4`` does not.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx

from ._loss_shapes import ShapeReading
from ._loss_values import (BAD, COUNT, FILLS, FREE, NLL, RANDOM, RATIO, REDUCING_LOSSES, ROWS, SCAN_OR_REDUCE, TOTAL,
                           Den, Form, LossForm, bad, in_place, is_pointwise, op_name, shape_of, source_of)

__all__ = ["Form", "LossForm", "Den", "read_loss"]



class _Reader(ShapeReading):
    """One pass over a traced loss (see :func:`read_loss`)."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Tuple[Optional[int], bool]], m: int,
                 counts: Set[Tuple[int, int]]) -> None:
        self.gm = gm
        self.inputs = list(inputs)
        self.m = m
        self.counts = counts  # (node index, arg position) of numbers linear in the batch size
        self.env: Dict[fx.Node, Any] = {}

    # -- helpers -----------------------------------------------------------------------
    def form(self, node: fx.Node, k: int, arg: Any) -> Form:
        """The form of argument ``k`` of ``node``: a node's, or a plain number's."""
        if isinstance(arg, fx.Node):
            f = self.env.get(arg)
            return f if isinstance(f, Form) else bad(f"{arg.name} is not a tensor this reading follows")
        if (self.index[node], k) in self.counts:
            return Form(COUNT)
        return Form(FREE, uniform=True)

    def rows_like(self, node: fx.Node, forms: Sequence[Form], shapes: Sequence[Optional[Tuple[int, ...]]]) -> Form:
        """Pointwise with broadcasting: the samples' dims must line up, and a free operand may
        vary along them only if it has size 1 there."""
        out = shape_of(node)
        if out is None:
            return bad(f"{source_of(node)} gives no tensor")
        rows = [(f, s) for f, s in zip(forms, shapes) if f.kind == ROWS]
        grad = any(f.grad for f in forms)
        output = any(f.output for f in forms)
        placed = {(f.dim + len(out) - len(s or ()), f.block) for f, s in rows}
        if len(placed) != 1:
            return bad(f"{source_of(node)} lines up different samples' values")
        dim, block = next(iter(placed))
        for f, s in zip(forms, shapes):
            if f.kind == FREE and not f.uniform and s is not None:
                at = dim - (len(out) - len(s))
                if 0 <= at < len(s) and s[at] > 1:
                    return bad(f"{source_of(node)} combines each position along the samples' dim with a "
                                "constant tensor of that length: samples would meet other values in a micro-batch")
        return Form(ROWS, grad=grad, output=output, dim=dim, block=block)

    # -- the pass --------------------------------------------------------------------------
    def run(self) -> Form:
        self.index = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        placeholders = 0
        result: Any = bad("the loss returns nothing")
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                dim, is_output = self.inputs[placeholders] if placeholders < len(self.inputs) else (None, False)
                placeholders += 1
                val = node.meta.get("val")
                grad = is_output and isinstance(val, Tensor) and val.is_floating_point()
                if dim is not None:
                    self.env[node] = Form(ROWS, grad=grad, output=is_output, dim=dim)
                elif is_output:  # one value per micro-batch (a 0-dim output merged by 'sum' or 'mean')
                    self.env[node] = bad(f"loss_fn uses output {node.name}, which holds one value per micro-batch, "
                                          "not one per sample: what it weighs in the whole batch cannot be read")
                else:
                    self.env[node] = Form(FREE, grad=grad, output=is_output)
            elif node.op == "get_attr":  # a constant, or a number of the batch size made a tensor
                self.env[node] = Form(COUNT) if (self.index[node], -1) in self.counts else Form(FREE)
            elif node.op == "call_function":
                try:
                    self.env[node] = self.call(node)
                except (IndexError, KeyError, TypeError, ValueError, AttributeError) as e:
                    self.env[node] = bad(f"{source_of(node)} could not be read ({type(e).__name__}: {e})")
            elif node.op == "output":
                ret = node.args[0]
                ret = ret[0] if isinstance(ret, (tuple, list)) and len(ret) == 1 else ret
                result = self.env.get(ret, bad("the loss is not a tensor")) if isinstance(ret, fx.Node) else \
                    bad("the loss is not a tensor")
            else:
                self.env[node] = bad(f"{node.op} {node.target}")
        return result

    def call(self, node: fx.Node) -> Any:
        form = self.call_named(node, op_name(node))
        if in_place(node) and node.args and isinstance(node.args[0], fx.Node):
            target = node.args[0]
            picked = self.env.get(target)  # the view's own form, before the write replaces it
            self.env[target] = form  # make_fx keeps mutations: the mutated tensor now holds the result
            self.written_through(node, target, picked)
        return form

    def call_named(self, node: fx.Node, name: str) -> Any:
        if node.target is operator.getitem:
            inner = self.env.get(node.args[0])
            return inner[node.args[1]] if isinstance(inner, (tuple, list)) else bad(f"{source_of(node)}")
        if not isinstance(node.target, torch._ops.OpOverload):
            # Python arithmetic on sizes (operator.mul of sym sizes): plain numbers, never tensors
            return Form(FREE, uniform=True)
        args = list(node.args)
        if name == "sym_size" or name == "sym_numel" or name == "sym_stride":
            return Form(FREE, uniform=True)
        if name in RANDOM:
            return bad(f"{source_of(node)} draws random numbers: each micro-batch draws others than the whole batch")
        if name in FILLS:
            src = self.env.get(args[0]) if args and isinstance(args[0], fx.Node) else None
            k = {"scalar_tensor": 0, "full": 1, "full_like": 1, "new_full": 2}.get(name)  # the fill value
            if k is not None and (self.index[node], k) in self.counts:
                return Form(COUNT)
            if isinstance(src, Form) and src.kind == ROWS and name.endswith("_like"):
                return Form(ROWS, dim=src.dim, block=src.block)
            return Form(FREE, uniform=True)
        if name in NLL:
            return self.nll(node, args)
        if name in REDUCING_LOSSES:
            k = REDUCING_LOSSES[name]
            tensors = [i for i, a in enumerate(args[:k]) if isinstance(a, fx.Node)]
            elementwise = self.pointwise(node, tensors, args, broadcast=lambda: self.broadcast_shape(args, tensors))
            reduction = args[k] if len(args) > k else node.kwargs.get("reduction", 1)
            if reduction == 0:
                return elementwise
            return self.reduce_all(node, elementwise, mean=reduction == 1)
        if name in ("sum", "mean"):
            return self.reduction(node, args, mean=name == "mean")
        if name in SCAN_OR_REDUCE:
            return self.along(node, args)
        if name in ("view", "_unsafe_view", "reshape"):
            return self.view(node, args)
        if name in ("permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice", "expand",
                    "split", "split_with_sizes", "unbind", "chunk", "narrow", "unfold", "repeat", "diagonal"):
            return self.move(node, name, args)
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            return self.matmul(node, name, args)
        if name in ("gather", "index_select", "embedding", "take_along_dim", "scatter", "scatter_add"):
            return self.indexing(node, name, args)
        if name in ("cat", "stack"):
            return self.join(node, name, args)
        if name == "index_put" and self.masked_put(args):  # y[y == pad] = -100: where(mask, -100, y)
            mask = args[1][0]
            return self.pointwise(node, [0, 1, 2], [args[0], mask, args[2]])
        if name == "where" or is_pointwise(node):
            operands = [i for i, a in enumerate(args)
                        if isinstance(a, fx.Node) or (isinstance(a, (int, float)) and not isinstance(a, bool))]
            return self.pointwise(node, operands, args)
        forms = [self.env.get(a) for a in node.all_input_nodes]
        if all(isinstance(f, Form) and f.kind == FREE for f in forms):
            return Form(FREE)
        return bad(f"{source_of(node)} is an op this reading of losses does not know")

    @staticmethod
    def masked_put(args: Sequence[Any]) -> bool:
        """Whether ``index_put`` writes through one boolean mask shaped as its target: elementwise."""
        indices = args[1] if len(args) > 1 else None
        if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], fx.Node)):
            return False
        mask, target = indices[0].meta.get("val"), args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        return (isinstance(mask, Tensor) and isinstance(target, Tensor) and mask.dtype == torch.bool
                and mask.shape == target.shape and not (len(args) > 3 and args[3]))

    def broadcast_shape(self, args: Sequence[Any], tensors: Sequence[int]) -> Optional[Tuple[int, ...]]:
        shapes = [shape_of(args[i]) for i in tensors]
        try:
            return tuple(torch.broadcast_shapes(*[s for s in shapes if s is not None]))
        except RuntimeError:
            return None

    def pointwise(self, node: fx.Node, positions: Sequence[int], args: Sequence[Any], broadcast: Any = None) -> Form:
        forms = [self.form(node, i, args[i]) for i in positions]
        shapes = [shape_of(args[i]) for i in positions]
        name = op_name(node)
        failed = next((f for f in forms if f.kind == BAD), None)
        if failed is not None:
            return failed
        kinds = {f.kind for f in forms}
        grad = any(f.grad for f in forms)
        output = any(f.output for f in forms)
        if name == "detach":
            forms = [replace(f, grad=False) for f in forms]
            return forms[0] if forms else Form(FREE)
        if kinds <= {FREE}:
            return Form(FREE, output=output, grad=grad, uniform=all(f.uniform for f in forms))
        if kinds <= {FREE, ROWS}:
            if broadcast is not None:  # a loss op's elementwise part: its broadcast shape
                shape = broadcast()
                if shape is None:
                    return bad(f"{source_of(node)}: operands that do not broadcast")
                return self.rows_of(node, forms, shapes, shape)
            return self.rows_like(node, forms, shapes)
        if ROWS in kinds:
            return bad(f"{source_of(node)} combines a sum over the samples with per-sample values")
        if COUNT in kinds and kinds & {TOTAL, RATIO}:
            if name == "div" and forms[0].kind == TOTAL and forms[0].grad and forms[1].kind == COUNT:
                return Form(RATIO, grad=True, output=True, den=Den("size"))
            return bad(f"{source_of(node)} multiplies a sum over the samples by a number that grows with them")
        if COUNT in kinds:
            return Form(COUNT) if name in ("mul", "_to_copy", "clone", "alias", "to", "lift_fresh_copy") and \
                sum(f.kind == COUNT for f in forms) == 1 else bad(f"{source_of(node)} on the batch size")
        return self.linear(node, name, forms, grad, output)

    def rows_of(self, node: fx.Node, forms: Sequence[Form], shapes: Sequence[Any], out: Tuple[int, ...]) -> Form:
        rows = [(f, s) for f, s in zip(forms, shapes) if f.kind == ROWS]
        placed = {(f.dim + len(out) - len(s or ()), f.block) for f, s in rows}
        if len(placed) != 1:
            return bad(f"{source_of(node)} lines up different samples' values")
        dim, block = next(iter(placed))
        return Form(ROWS, grad=any(f.grad for f in forms), output=any(f.output for f in forms), dim=dim, block=block)

    def linear(self, node: fx.Node, name: str, forms: Sequence[Form], grad: bool, output: bool) -> Form:
        """Sums over the samples (and ratios of them) combined with each other and with free values."""
        sums = [f for f in forms if f.kind in (TOTAL, RATIO)]
        if name in ("_to_copy", "clone", "alias", "to", "contiguous", "lift_fresh_copy", "positive"):
            return forms[0]
        if name in ("neg",):
            return forms[0]
        if name in ("add", "sub", "rsub"):
            if len(sums) == 1 and any(isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0
                                      for a in node.args):
                return sums[0]  # `0 + loss` (Python's sum() starts from 0)
            shift = _small_constant(node, name)
            if len(sums) == 1 and sums[0].kind == TOTAL and not sums[0].output and shift is not None:
                return replace(sums[0], shift=sums[0].shift + shift)  # a count kept off 0: checked per call
            if len(sums) == 1 and sums[0].kind == RATIO and all(f.kind == FREE for f in forms if f is not sums[0]):
                # a mean plus a constant (an L2 penalty on weights, uncertainty weighting's `+ s`): the
                # micro-batches' weights add up to 1, so the constant counts once, its gradient too
                return replace(sums[0], grad=grad, output=output)
            if len(sums) == 1:
                other = next(f for f in forms if f.kind not in (TOTAL, RATIO))
                # adding a constant would count it once per micro-batch; a data-only total's
                # constant shift is harmless only where it is no denominator: refused alike
                return bad(f"{source_of(node)} adds a constant to a sum over the samples: each micro-batch "
                            "would count it once") if other.kind == FREE else bad(source_of(node))
            a, b = sums
            if a.kind == TOTAL and b.kind == TOTAL:
                return Form(TOTAL, grad=grad, output=output)
            if a.kind == RATIO and b.kind == RATIO:
                # a sum of means: one weight per micro-batch serves every term where the counts
                # are proportional across the micro-batches, checked per call
                dens = [d for d in (a.den, *a.also) if d is not None]
                dens += [d for d in (b.den, *b.also) if d is not None and d not in dens]
                return Form(RATIO, grad=grad, output=output, den=dens[0], also=tuple(dens[1:]))
            return bad(f"{source_of(node)} adds a sum over the samples to a mean: no one weight per micro-batch "
                        "gives both")
        if name in ("mul", "div"):
            if len(sums) == 2:
                a, b = forms
                if name == "div" and a.kind == TOTAL and a.grad and b.kind == TOTAL and not b.output:
                    return Form(RATIO, grad=True, output=True, den=Den("data", node.args[1], shift=b.shift))
                return bad(f"{source_of(node)} multiplies or divides two sums over the samples")
            first = forms[0]
            if name == "div" and first.kind not in (TOTAL, RATIO):
                return bad(f"{source_of(node)} divides by a sum over the samples")
            return Form(sums[0].kind, grad=grad, output=output, den=sums[0].den, also=sums[0].also)
        return bad(f"{source_of(node)} is not linear in a sum over the samples")

    def nll(self, node: fx.Node, args: Sequence[Any]) -> Tuple[Form, Form]:
        inp, target = self.form(node, 0, args[0]), self.form(node, 1, args[1])
        weight = self.form(node, 2, args[2]) if len(args) > 2 and isinstance(args[2], fx.Node) else Form(FREE)
        reduction = args[3] if len(args) > 3 else 1
        if BAD in (inp.kind, target.kind, weight.kind):
            failed = next(f for f in (inp, target, weight) if f.kind == BAD)
            return failed, failed
        if weight.kind != FREE:
            return bad(f"{source_of(node)}: class weights that depend on the samples"), bad("")
        # input (N, C[, H, W]) and target (N[, H, W]): the samples along N in both, alike
        if inp.kind != ROWS or target.kind != ROWS or inp.dim != 0 or target.dim != 0 or inp.block != target.block:
            why = f"{source_of(node)}: the loss's input and target do not hold the samples in their first dim alike"
            return bad(why), bad(why)
        per = Form(ROWS, grad=inp.grad, output=True, dim=0, block=target.block)
        den = Form(TOTAL, output=target.output, grad=False)
        if reduction == 0:
            return per, den
        if target.output:
            return bad(f"{source_of(node)}: the target is computed from the model's output"), den
        if reduction == 2:
            return Form(TOTAL, grad=inp.grad, output=True), den
        return Form(RATIO, grad=inp.grad, output=True, den=Den("data", node)), den

    def reduce_all(self, node: fx.Node, form: Form, mean: bool) -> Form:
        if form.kind == BAD:
            return form
        if form.kind == ROWS:
            if mean:
                return Form(RATIO, grad=form.grad, output=form.output, den=Den("size"))
            return Form(TOTAL, grad=form.grad, output=form.output)
        if form.kind in (TOTAL, RATIO, FREE):
            return form  # averaged over its own fixed dims: linear
        return bad(source_of(node))

    def reduction(self, node: fx.Node, args: Sequence[Any], mean: bool) -> Form:
        form = self.form(node, 0, args[0])
        shape = shape_of(args[0]) or ()
        dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
        keep = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
        if isinstance(dims, int):
            dims = [dims]
        if dims is None or len(dims) == 0 or not isinstance(dims, (list, tuple)):
            return self.reduce_all(node, form, mean)
        dims = sorted({d % max(len(shape), 1) for d in dims})
        if form.kind != ROWS:
            return form  # a sum over the samples (or constants) averaged over its own fixed dims: linear
        if form.dim in dims:
            # over the samples (and maybe more): a sum of per-sample sums
            if mean:
                return Form(RATIO, grad=form.grad, output=form.output, den=Den("size"))
            return Form(TOTAL, grad=form.grad, output=form.output)
        dim = form.dim if keep else form.dim - sum(d < form.dim for d in dims)
        return replace(form, dim=dim)

    def along(self, node: fx.Node, args: Sequence[Any]) -> Any:
        form = self.form(node, 0, args[0])
        name = op_name(node)
        shape = shape_of(args[0]) or ()
        if form.kind == FREE:  # a scan or reduction of constants varies along its dims (cumsum of ones)
            out = node.meta.get("val")
            free = replace(form, uniform=False)
            return (free, free) if isinstance(out, (tuple, list)) else free
        if form.kind != ROWS:
            return form if form.kind == BAD else bad(f"{source_of(node)} is not linear in a sum over the samples")
        dims: Any = args[1] if len(args) > 1 else node.kwargs.get("dim")
        if name in ("_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin") \
                and dims is None:
            dims = node.kwargs.get("dim")
        if name == "topk" or name == "kthvalue":
            dims = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
        if name in ("linalg_vector_norm", "norm"):
            dims = args[2] if len(args) > 2 else node.kwargs.get("dim")
        if name == "roll":
            dims = args[2] if len(args) > 2 else node.kwargs.get("dims")
        if isinstance(dims, int):
            dims = [dims]
        if not dims:
            return bad(f"{source_of(node)} reduces over every dim, the samples' too: it mixes the samples")
        dims = [d % max(len(shape), 1) for d in dims]
        if form.dim in dims:
            return bad(f"{source_of(node)} works across the samples' dim: it mixes the samples")
        out = node.meta.get("val")
        first = out[0] if isinstance(out, (tuple, list)) else out
        keep = isinstance(first, Tensor) and first.dim() == len(shape)
        dim = form.dim if keep else form.dim - sum(d < form.dim for d in dims)
        moved = replace(form, dim=dim)
        return (moved, replace(moved, grad=False)) if isinstance(out, (tuple, list)) else moved


def read_loss(gm: fx.GraphModule, inputs: Sequence[Tuple[Optional[int], bool]], m: int,
              counts: Set[Tuple[int, int]]) -> LossForm:
    """The :class:`LossForm` of a traced loss ``gm`` with ``m >= 2`` samples per batch.
    ``inputs``: per placeholder, the dim holding the samples (None: none) and whether it is
    the model's output (where the gradient enters)."""
    form = _Reader(gm, inputs, m, counts).run()
    if form.kind == TOTAL and form.grad:
        return LossForm("sum")
    if form.kind == RATIO and form.grad:
        return LossForm("mean", den=form.den, also=form.also)
    if form.kind == BAD:
        return LossForm(None, why=form.why)
    what = {ROWS: "is not reduced to one value per batch", FREE: "does not depend on the samples",
            COUNT: "is a size"}.get(form.kind, "carries no gradient from the model's output")
    return LossForm(None, why=f"the loss {what}")


#: the largest constant a count of the target may add and still be read as that count
SMALL_SHIFT = 1e-3


def _small_constant(node: fx.Node, name: str) -> Optional[float]:
    """``c`` of ``count + c`` (``add``, one operand a number with ``0 < |c| <= SMALL_SHIFT``),
    else None."""
    if name != "add":
        return None
    numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    alpha = node.kwargs.get("alpha", 1)
    if len(numbers) != 1 or alpha != 1 or not 0 < abs(numbers[0]) <= SMALL_SHIFT:
        return None
    return float(numbers[0])
