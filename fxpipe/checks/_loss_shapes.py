"""How a loss's reading follows the samples through ops that move, join or index tensors.

A mixin of :class:`fxpipe.checks._loss_form._Reader`: views and reshapes (the samples' dim may
merge with its neighbours and split again, as long as each sample's elements stay together:
``block``), permutes, selections and slices (refused where they pick samples), matrix
products (per sample, or a sum over the samples when they are contracted, or refused where
they multiply different samples with each other), gathers and scatters, and joins.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Sequence

from torch import fx

from ._loss_values import BAD, FREE, ROWS, TOTAL, VIEWS, Form, bad, numel, op_name, shape_of, source_of

__all__ = ["ShapeReading"]



class ShapeReading:
    """The reader's handlers of moving, joining and indexing ops (see the module docstring)."""

    env: Dict[fx.Node, Any]
    m: int

    def form(self, node: fx.Node, k: int, arg: Any) -> Form:  # the reader's
        raise NotImplementedError

    def written_through(self, node: fx.Node, target: fx.Node, picked: Any) -> None:
        """A write into a view reaches its base: where the view picks samples by position
        (``y[8:] = -100``, ``y[::3] = -100``: its form ``picked``, before the write, is bad), the
        base is no longer per sample (a trial: each micro-batch masked its own rows 8 onwards,
        0.116 off, silently). A view along the samples' own dims (``y[:, :2] = -100``, a prompt
        masked) keeps the base per sample."""
        view = target
        while view.op == "call_function" and op_name(view) in VIEWS and view.args and isinstance(view.args[0], fx.Node):
            picked = picked if view is target else self.env.get(view)
            base = view.args[0]
            if isinstance(picked, Form) and picked.kind == BAD and isinstance(self.env.get(base), Form):
                self.env[base] = bad(f"{source_of(node)} writes into the samples a view picks by their position in "
                                     f"the batch ({picked.why or source_of(view)}): each micro-batch would write "
                                     "other samples")
            view = base

    def view(self, node: fx.Node, args: Sequence[Any]) -> Form:
        form = self.form(node, 0, args[0])
        if form.kind != ROWS:
            return form
        before, after = shape_of(args[0]), shape_of(node)
        if before is None or after is None:
            return bad(source_of(node))
        outer, inner = form.block
        rest = numel(before[form.dim + 1:]) * inner  # elements per sample per block, past the samples
        block = self.m * rest                          # one run of every sample
        for e in range(len(after)):
            tail = numel(after[e + 1:])
            if tail and rest % tail == 0 and (after[e] * tail) % block == 0 and after[e] >= self.m:
                return replace(form, dim=e, block=((after[e] * tail) // block, rest // tail))
        return bad(f"{source_of(node)} reshapes the samples' dim so that samples share a row")

    def move(self, node: fx.Node, name: str, args: Sequence[Any]) -> Any:
        form = self.form(node, 0, args[0])
        if form.kind != ROWS:
            return form
        shape = shape_of(args[0]) or ()
        nd = len(shape)
        d = form.dim
        out = node.meta.get("val")
        if name == "permute":
            return replace(form, dim=[x % nd for x in args[1]].index(d))
        if name == "transpose":
            a, b = args[1] % nd, args[2] % nd
            return replace(form, dim=b if d == a else a if d == b else d)
        if name == "t":
            return replace(form, dim=(1 - d) if nd == 2 else d)
        if name == "unsqueeze":
            at = args[1] % (nd + 1)
            return replace(form, dim=d + (at <= d))
        if name == "squeeze":
            after = shape_of(node) or ()
            removed = len(shape) - len(after)
            drop = [i for i, s in enumerate(shape) if s == 1][:removed] if removed else []
            if len(args) > 1:
                want = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
                drop = [w % nd for w in want if shape[w % nd] == 1]
            if d in drop:
                return bad(source_of(node))
            return replace(form, dim=d - sum(x < d for x in drop))
        if name == "expand":
            after = shape_of(node) or ()
            moved = d + len(after) - nd
            return replace(form, dim=moved) if after[moved] == shape[d] else bad(source_of(node))
        if name in ("select", "slice", "narrow", "split", "split_with_sizes", "unbind", "chunk", "unfold",
                    "diagonal", "repeat"):
            at = (args[1] if len(args) > 1 else node.kwargs.get("dim", 0))
            if name in ("split", "split_with_sizes", "chunk"):
                at = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
            if name == "repeat":
                return replace(form, dim=d + len(args[1]) - nd) if args[1][d - nd] == 1 else bad(
                    f"{source_of(node)} repeats the samples")
            if name == "diagonal":
                return bad(source_of(node))
            at = at % nd
            if at != d:
                if name == "select" or name == "unbind":
                    moved = replace(form, dim=d - (at < d))
                    return [moved] * shape[at] if name == "unbind" else moved
                return [form] * len(out) if isinstance(out, (tuple, list)) else form
            if name == "slice":
                start = args[2] if len(args) > 2 else 0
                end = args[3] if len(args) > 3 else None
                step = args[4] if len(args) > 4 else 1
                if (start in (0, None)) and (end is None or end >= shape[d]) and step == 1:
                    return form
            return bad(f"{source_of(node)} picks some samples of the batch (or some positions of the samples' dim)")
        return bad(source_of(node))

    def matmul(self, node: fx.Node, name: str, args: Sequence[Any]) -> Form:
        operands = list(args[1:3]) if name in ("addmm", "baddbmm") else list(args[:2])
        a, b = (self.form(node, i, x) for i, x in enumerate(operands))
        bias = self.form(node, 0, args[0]) if name in ("addmm", "baddbmm") else Form(FREE, uniform=True)
        if BAD in (a.kind, b.kind, bias.kind):
            return next(f for f in (a, b, bias) if f.kind == BAD)
        grad, output = a.grad or b.grad or bias.grad, a.output or b.output or bias.output
        nd = 3 if name in ("bmm", "baddbmm") else 2
        kept_a, contracted_a, contracted_b, kept_b = nd - 2, nd - 1, nd - 2, nd - 1
        if a.kind == ROWS and b.kind == ROWS and nd == 3 and a.dim == b.dim == 0 and a.block == b.block:
            out = Form(ROWS, grad=grad, output=output, dim=0, block=a.block)
        elif a.kind == ROWS and b.kind == FREE and a.dim == kept_a:
            out = Form(ROWS, grad=grad, output=output, dim=kept_a, block=a.block)
        elif b.kind == ROWS and a.kind == FREE and b.dim == kept_b:
            out = Form(ROWS, grad=grad, output=output, dim=kept_b, block=b.block)
        elif a.kind == ROWS and b.kind == ROWS and a.dim == contracted_a and b.dim == contracted_b \
                and a.block == b.block and nd == 2:
            out = Form(TOTAL, grad=grad, output=output)
        elif a.kind == FREE and b.kind == FREE:
            out = Form(FREE, grad=grad, output=output)
        else:
            return bad(f"{source_of(node)} multiplies values of different samples with each other "
                        "(an in-batch similarity matrix): it mixes the samples")
        if bias.kind not in (FREE,) and not (bias.kind == ROWS and out.kind == ROWS):
            return bad(source_of(node))
        return out

    def indexing(self, node: fx.Node, name: str, args: Sequence[Any]) -> Form:
        if name == "embedding":
            weight, idx = self.form(node, 0, args[0]), self.form(node, 1, args[1])
            if weight.kind == FREE and idx.kind == ROWS:
                return Form(ROWS, grad=weight.grad or idx.grad, output=idx.output, dim=idx.dim, block=idx.block)
            return Form(FREE) if idx.kind == FREE and weight.kind == FREE else bad(source_of(node))
        src = self.form(node, 0, args[0])
        dim = args[1]
        idx = self.form(node, 2, args[2])
        extra = [self.form(node, 3, args[3])] if name in ("scatter", "scatter_add") and len(args) > 3 else []
        failed = next((f for f in (src, idx, *extra) if f.kind == BAD), None)
        if failed is not None:
            return failed
        nd = len(shape_of(args[0]) or ())
        dim = dim % max(nd, 1)
        grad = any(f.grad for f in (src, idx, *extra))
        output = any(f.output for f in (src, idx, *extra))
        rows = [f for f in (src, idx, *extra) if f.kind == ROWS]
        if any(f.kind not in (ROWS, FREE) for f in (src, idx, *extra)):
            return bad(f"{source_of(node)} indexes with a sum over the samples")
        if not rows:
            return Form(FREE, grad=grad, output=output)
        placed = {(f.dim, f.block) for f in rows}
        if len(placed) != 1:
            return bad(f"{source_of(node)} lines up different samples' values")
        d, block = next(iter(placed))
        if name == "gather" and src.kind == FREE and idx.kind == ROWS:  # class weights of the targets
            return Form(ROWS, grad=grad, output=output, dim=idx.dim, block=idx.block)
        if name == "index_select" and idx.kind == ROWS:
            return bad(f"{source_of(node)} indexes along the samples' dim")
        if src.kind == ROWS and dim != d and all(f.kind == ROWS or name == "index_select" for f in (idx, *extra)):
            return Form(ROWS, grad=grad, output=output, dim=d, block=block)
        return bad(f"{source_of(node)} indexes along the samples' dim")

    def join(self, node: fx.Node, name: str, args: Sequence[Any]) -> Form:
        parts = [self.env.get(a) if isinstance(a, fx.Node) else Form(FREE, uniform=True) for a in args[0]]
        at = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        if not all(isinstance(f, Form) for f in parts):
            return bad(source_of(node))
        if all(f.kind == FREE for f in parts):
            return Form(FREE)
        first = shape_of(args[0][0]) or ()
        nd = len(first) + (name == "stack")
        at = at % max(nd, 1)
        rows = {(f.dim, f.block) for f in parts if f.kind == ROWS}
        if len(rows) == 1 and all(f.kind == ROWS for f in parts):
            d, block = next(iter(rows))
            if name == "stack":
                d = d + (at <= d)
            if at != d:
                return Form(ROWS, grad=any(f.grad for f in parts), output=any(f.output for f in parts),
                            dim=d, block=block)
        return bad(f"{source_of(node)} joins tensors along the samples' dim or mixes per-sample and other values")
