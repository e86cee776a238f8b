"""What a dynamic torch.export capture assumed of the sizes it kept symbolic, checked per call.

fxpipe exports with every dim of every tensor input declared ``Dim.AUTO``
(:mod:`fxpipe.capture._export`): torch.export keeps a size symbolic where the model's code works
for any value of it, and specialises it where the code depends on it (a size of 1 in the sample,
a reshape to a fixed width), which :attr:`Capture.fixed <fxpipe.capture._tracing.Capture>` then
checks. What export keeps symbolic still comes with guards: sizes that must be equal (one
symbol for ``input_ids``' and ``attention_mask``'s length), a range per symbol (at least 2,
since export treats sizes 0 and 1 apart), sizes derived from others (``s0 + 1``). The graph is
exact at every size that meets them -- torch.export's contract -- and only there, so
:meth:`ShapeGuards.problems` checks each call against them, as ``ExportedProgram.module()``
checks its inputs, and names the arguments that break one. The split dim (the batch) is left
out: micro-batches of one sample are split off any batch, and the build's check runs them.

Why the build's micro-batch check, run at the sample's sizes, stays proven at every other size
the guards admit (the argument, instead of the check run again at each new shape, which a
model whose stages sit on several devices, or ranks that hold only their stages, cannot run):
the graph is one program over symbolic sizes, so each op combines the same elements at every
size; a sample's rows can come to be combined at another size only where a size mixes the
batch with another size other than as a product -- ``view(b * t // 2, 2, d)`` pairs up rows
within each sample when ``t`` is even, across samples when it is odd. :func:`entangled_size`
looks for such a size (``s0 * s1`` is a product: the flattened rows of each sample stay
together; ``(s0 * s1) // 2`` or ``s0 + s1`` are not), and the capture then keeps every size
but the batch fixed, as before any length varied. The argument rests on torch.export's own
contract (one graph, exact wherever the guards hold) and on that scan; nothing runs per call
but the guards' check (a few integer comparisons per input).

The sizes a capture fixed (:func:`fixed_dims`, :func:`fixed_batch`) are read here too. The
ranges and sizes are kept as plain values (names, ints, expression strings); the other
guards as sympy expressions, without the export's shape environment.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Sequence, Tuple

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["ShapeGuards", "entangled_size", "fx_entangled_size", "symbolic_inputs", "fixed_dims", "fixed_batch",
           "split_dim", "size_expr", "bound", "fake_state"]


@dataclass(frozen=True)
class ShapeGuards:
    """Per flat input index, per dim: the symbolic size the graph assumes (a symbol's name or
    an expression in the symbols, as text), or None (a fixed size, the split dim, any size);
    ``ranges``: each symbol's least and greatest value (None: no bound); ``conditions``: the
    other guards export recorded (the model's code branched on ``t % 2 == 0``: the graph holds
    that branch only), as sympy expressions; ``places``: where each symbol is read, ``(flat
    index, dim)``; ``batch``: the split dims' symbols, bound per micro-batch."""

    dims: dict[int, tuple[str | None, ...]] = field(default_factory=dict)
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    conditions: tuple[Any, ...] = ()
    places: dict[str, tuple[int, int]] = field(default_factory=dict)
    batch: frozenset[str] = frozenset()

    @classmethod
    def of(cls, gm: fx.GraphModule, flat: Sequence[Any], split_dims: Sequence[int | None] | None,
           range_constraints: Mapping[Any, Any]) -> "ShapeGuards":
        """The guards of an exported graph whose placeholders hold the export's fake values."""
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        batch: set[str] = set()  # symbols of split dims: not checked, nor anything made from them
        dims: dict[int, tuple[str | None, ...]] = {}
        places: dict[str, tuple[int, int]] = {}
        env = None
        for i, (node, v) in enumerate(zip(phs, flat)):
            val = node.meta.get("val")
            if not isinstance(v, torch.Tensor) or not isinstance(val, torch.Tensor) or val.dim() != v.dim():
                continue
            env = env or getattr(getattr(val, "fake_mode", None), "shape_env", None)
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    places.setdefault(str(size.node.expr), (i, d))
            split = split_dim(split_dims, i, v)
            exprs = [str(s.node.expr) if isinstance(s, torch.SymInt) and not s.node.expr.is_number else None
                     for s in val.shape]  # fixed sizes: Capture.fixed
            if split is not None and exprs[split] is not None:
                batch |= {str(x) for x in sympy.sympify(exprs[split]).free_symbols}
                exprs[split] = None
            dims[i] = tuple(exprs)
        for i, exprs in list(dims.items()):
            dims[i] = tuple(None if e is None or {str(x) for x in sympy.sympify(e).free_symbols} & batch else e
                            for e in exprs)
            if all(e is None for e in dims[i]):
                del dims[i]
        ranges = {str(sym): (bound(vr.lower) or 0, bound(vr.upper)) for sym, vr in range_constraints.items()}
        return cls(dims, ranges, _conditions(env, set(places)), places, frozenset(batch))

    def problems(self, flat: Sequence[Any], names: Sequence[str]) -> list[tuple[str, str]]:
        """``(what differs, what to do)`` for each size of this call that breaks a guard (those
        on the batch: :meth:`micro_problems`)."""
        if not self.dims and not self.conditions:
            return []
        bound: dict[str, tuple[int, str]] = {}  # symbol -> (size, 'dim d of name') that set it
        derived: list[tuple[str, int, str]] = []
        out: list[tuple[str, str]] = []
        for i, exprs in self.dims.items():
            v = flat[i]
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() != len(exprs):
                out.append((f"{names[i]} has {v.dim()} dims but the sample's had {len(exprs)}",
                            f"pass {names[i]} with {len(exprs)} dims, as in the sample"))
                continue
            for d, e in enumerate(exprs):
                if e is None:
                    continue
                where, size = f"dim {d} of {names[i]}", int(v.shape[d])
                if e not in self.ranges and not e.isidentifier():
                    derived.append((e, size, where))
                elif e in bound and bound[e][0] != size:
                    size0, where0 = bound[e]
                    out.append((f"{where} is {size}, but {where0} is {size0}, and the model's graph has them equal "
                                "(torch.export found the model's code needs them equal)",
                                "pass sizes that agree, as the model itself needs"))
                elif e not in bound:
                    bound[e] = (size, where)
                    out += self._out_of_range(e, size, where)
        for e, size, where in derived:
            values = {s: bound[s][0] for s in map(str, sympy.sympify(e).free_symbols) if s in bound}
            want = sympy.sympify(e).subs(values)
            if want.is_number and int(want) != size:
                out.append((f"{where} is {size}, but the model's graph has it equal to {e} = {int(want)} here",
                            "pass sizes related as the model needs"))
        return out or self._broken(flat, names, batch=False)

    def micro_problems(self, micro: Sequence[Any], names: Sequence[str]) -> list[tuple[str, str]]:
        """The guards on the batch's symbols, at one micro-batch's sizes (the graph runs each
        micro-batch, so each must take the sample's branch)."""
        return self._broken(micro, names, batch=True) if self.batch else []

    def _broken(self, flat: Sequence[Any], names: Sequence[str], batch: bool) -> list[tuple[str, str]]:
        """The conditions that fail at ``flat``'s sizes: those without the batch's symbols, or
        (``batch``) those with them."""
        by_name = {sym: sympy.Integer(int(flat[i].shape[d])) for sym, (i, d) in self.places.items()
                   if isinstance(flat[i], torch.Tensor) and flat[i].dim() > d}
        out = []
        for cond in self.conditions:
            symbols = {str(x) for x in cond.free_symbols}
            if bool(symbols & self.batch) != batch or not symbols <= set(by_name):
                continue
            held = cond.xreplace({x: by_name[str(x)] for x in cond.free_symbols})
            if held is sympy.false:
                named = {x: sympy.Symbol(f"{names[self.places[str(x)][0]]}.shape[{self.places[str(x)][1]}]")
                         for x in cond.free_symbols}
                sizes = ", ".join(f"{named[x]} = {by_name[str(x)]}" for x in sorted(cond.free_symbols, key=str))
                out.append((f"the model's code took a branch on its sizes when it was captured, and torch.export "
                            f"kept that branch only: its guard {_text(cond.xreplace(named))} does not hold with "
                            f"{sizes} (eager would run other code)",
                            "build a pipeline from a sample whose sizes take this branch, or pass sizes that take the "
                            "sample's"))
        return out

    def _out_of_range(self, sym: str, size: int, where: str) -> list[tuple[str, str]]:
        lo, hi = self.ranges.get(sym, (0, None))
        if lo <= size and (hi is None or size <= hi):
            return []
        span = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
        if hi is not None and size > hi:  # an upper bound comes from the model's code: a table's size
            return [(f"{where} is {size}, but the captured graph holds for sizes {span} only: the model's code bounds "
                     f"it at {hi} (a position table of {hi} entries, say), and eager fails or runs other code past it",
                     f"pass at most {hi} there, the model's own limit")]
        why = " (torch.export treats sizes 0 and 1 apart, and the sample's was larger)" if size < 2 <= lo else ""
        return [(f"{where} is {size}, but the captured graph holds for sizes {span} only{why}",
                 f"build a pipeline from a sample with {size} there (pipelines of one model share its parameters)")]


def split_dim(split_dims: Sequence[int | None] | None, i: int, x: Any) -> int | None:
    """The dim flat input ``i`` (``x``) is split along, made non-negative; None for one that is
    not split (a non-tensor, a 0-dim tensor, ``chunk_dims`` None). Default: dim 0."""
    if not isinstance(x, torch.Tensor) or not x.dim():
        return None
    split = split_dims[i] if split_dims is not None and i < len(split_dims) else 0
    return split % x.dim() if split is not None else None


def size_expr(size: Any) -> Any:
    """A size as it was made: a SymInt's expression before later replacements (``SymNode.expr``
    applies those a later op made), an int as it is."""
    return sympy.sympify(size.node._expr) if isinstance(size, torch.SymInt) else int(size)


def fixed_dims(gm: torch.fx.GraphModule, flat: Sequence[Any],
               split_dims: Sequence[int | None] | None) -> dict[int, tuple[int | None, ...]]:
    """Per flat tensor input: its size in each dim the graph was specialised on, ``None`` where
    the graph takes any size (the split dim, which micro-batches change).

    Read from the placeholders' ``meta['val']``, which torch.export leaves on them: a plain int
    is a size export specialised (fxpipe declares every dim ``Dim.AUTO``: export fixes a size
    of 1 in the sample and the sizes the model's code depends on), a SymInt one it kept
    symbolic (its guards: :class:`ShapeGuards`). An fx graph records no sizes: its ops take
    their shapes from their inputs, so it has nothing fixed here (the capture fixes every size
    but the batch's where :func:`fx_entangled_size` finds a size regrouping the batch).
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[int, tuple[int | None, ...]] = {}
    for i, (node, v) in enumerate(zip(phs, flat)):
        val = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(val, torch.Tensor) or val.dim() != v.dim():
            continue
        split = split_dim(split_dims, i, v)
        sizes = tuple(None if d == split or _symbolic(s) else int(s) for d, s in enumerate(val.shape))
        if any(s is not None for s in sizes):
            out[i] = sizes
    return out


def _symbolic(size: Any) -> bool:
    """A size export kept symbolic (a SymInt of a constant, as export may leave one, is fixed)."""
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


def fixed_batch(gm: torch.fx.GraphModule, flat: Sequence[Any], split_dims: Sequence[int | None] | None) -> bool:
    """Whether torch.export specialised the split dim itself: it does for a batch of one (its
    0/1 specialisation), and then every micro-batch must hold one sample. (A larger sample
    with a fixed batch cannot be split at all and is refused by the build's check.)"""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (node, v) in enumerate(zip(phs, flat)):
        val = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(val, torch.Tensor) or val.dim() != v.dim() or not v.dim():
            continue
        split = split_dim(split_dims, i, v)
        if split is not None and isinstance(val.shape[split], int):  # 0/1-specialised
            return True
    return False


def bound(value: Any) -> int | None:
    """A range's bound as an int; None for an infinite one (torch's ``int_oo``)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def entangled_size(ep: Any, flat: Sequence[Any], split_dims: Sequence[int | None] | None) -> str | None:
    """The first size of an exported program that combines the batch's symbol with another
    symbol other than as a product (see the module docstring), as text; None when there is none."""
    users = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(flat):] if flat else []
    batch: set[Any] = set()
    for i, (node, v) in enumerate(zip(users, flat)):
        val = node.meta.get("val")
        split = split_dim(split_dims, i, v)
        if split is not None and isinstance(val, torch.Tensor) and val.dim() == v.dim() \
                and isinstance(val.shape[split], torch.SymInt):
            batch |= val.shape[split].node.expr.free_symbols
    return _entangled(((node.name, node.meta.get("val")) for node in ep.graph.nodes), batch)


def _entangled(values: Iterable[tuple[str, Any]], batch: set[Any]) -> str | None:
    """The first of ``values`` (name, value) holding a size that combines a symbol of ``batch``
    with another symbol other than as a product, as text."""
    if not batch:
        return None
    seen: set[Any] = set()
    for name, value in values:
        for size in _sizes(value):
            expr = size.node.expr
            if expr in seen:
                continue
            seen.add(expr)
            symbols = expr.free_symbols
            if not symbols & batch or not symbols - batch:
                continue  # the batch alone is the build's check's; no batch: the same rows
            for b in symbols & batch:
                rest, factor = expr.as_independent(b, as_Add=False)  # b * rest, or not a product
                if factor != b or not rest.is_polynomial():
                    return f"{name}: {expr}"
    return None


def fx_entangled_size(gm: fx.GraphModule, flat: Sequence[Any], split_dims: Sequence[int | None] | None) -> str | None:
    """:func:`entangled_size` for a torch.fx capture, which records no sizes: the graph run once
    under a ``FakeTensorMode`` over symbolic input sizes (each its own symbol, at least 2), every
    node's sizes scanned. None also when the graph cannot run so (no claim made: the build's
    check at the sample's sizes stands alone, as before)."""
    if not any(_regroups(n) for n in gm.graph.nodes):
        return None  # no op that could lay rows out anew: nothing to scan (most fx graphs: no cost)
    key = (gm.code, SCAN_SECONDS, tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat))
    if key in _OVER_BUDGET:  # the same graph again (the capture in the other mode): it would run out again
        return _OVER_BUDGET[key]
    from torch._dispatch.python import enable_python_dispatcher

    mode, values, slots = symbolic_inputs(flat)
    batch: set[Any] = set()
    for i, dims in slots.items():
        split = split_dim(split_dims, i, flat[i])
        if split is not None and not isinstance(dims[split], int):
            batch |= dims[split].free_symbols
    seen: list[tuple[str, Any]] = []
    began = time.thread_time()

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if time.thread_time() - began > SCAN_SECONDS:
                raise _OverBudget
            out = super().run_node(n)
            seen.append((n.name, out))
            return out

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # logs each op that needs concrete sizes
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        for dispatcher in (contextlib.nullcontext, enable_python_dispatcher):
            # again through the python dispatcher where an op needs it (F.pad over symbols), as export runs
            seen.clear()
            try:
                with mode, torch.no_grad(), dispatcher(), fake_state(gm, mode):
                    _Recorder(gm).run(*values)
                break
            except _OverBudget:  # sympy over many symbols (GroupNorm blocks: 15 s each, a trial): sizes kept
                if len(_OVER_BUDGET) >= 8:
                    _OVER_BUDGET.pop(next(iter(_OVER_BUDGET)))
                found = f"a size (the scan over any size ran past its {SCAN_SECONDS:g} s budget of CPU time)"
                _OVER_BUDGET[key] = found
                return found
            except Exception:  # noqa: BLE001 - code that needs concrete sizes: no symbolic claim
                if dispatcher is enable_python_dispatcher:
                    return None
    finally:
        quiet.setLevel(level)
    return _entangled(((name, v) for name, out in seen for v in pytree.tree_leaves(out)), batch)


#: seconds of this thread's CPU time the symbolic scan of a torch.fx graph may take; past it the
#: capture keeps every size but the batch's, as where a size regroups the rows (a diffusion U-Net's
#: scan took minutes, a trial). CPU time, not the clock's: with 5 s of wall time a model's
#: accepted lengths followed the machine's load (a transformers model with gradient checkpointing
#: scanned in 5.2 s in a process's first build, 3.7 s in its second; Bloom's test failed under a
#: busy CI), and 10 s leaves a first build's one-time costs room
SCAN_SECONDS = 10.0


#: the graphs (code and input sizes) whose scan ran past the budget, and the answer: a build
#: captures a graph that follows the modes twice (once per mode), and its second scan would pay
#: the budget again for the same answer (a review: 22 s builds where 12 s gave the same sizes)
_OVER_BUDGET: Dict[Tuple[str, float, Tuple[Any, ...]], str] = {}


class _OverBudget(Exception):
    """The symbolic scan ran past :data:`SCAN_SECONDS`."""


#: ops that can lay out a tensor's rows anew, or read sizes to compute with: a graph without any
#: has no size that could regroup the batch's rows
_REGROUPING = {"view", "reshape", "unflatten", "pad", "view_as", "reshape_as", "narrow", "unfold", "split",
               "chunk", "as_strided", "repeat", "size", "shape", "numel", "tensor_split", "getattr"}


def symbolic_inputs(flat: Sequence[Any], device: torch.device | None = None) -> tuple[Any, list[Any], dict[int, list[Any]]]:
    """A ``FakeTensorMode`` over a fresh ``ShapeEnv``, ``flat`` with each tensor a fake of it whose
    every size is a symbol of its own, and per tensor's index each dim's symbol (the int where
    torch fixed it). No duck sizing: two sizes equal in the sample may differ later, so what
    the code needs equal becomes a guard. Each size is made at least 2 (torch specialises 0 and
    1). Guards that cannot be decided become deferred runtime asserts rather than fixing a size.
    ``device``: where the fakes are (default: each tensor's own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False, prefer_deferred_runtime_asserts_over_guards=True),
                          allow_non_fake_inputs=True)
    values: list[Any] = []
    slots: dict[int, list[Any]] = {}
    for i, x in enumerate(flat):  # real (small) tensors made fake: outside the mode
        if not isinstance(x, torch.Tensor) or not x.dim():
            values.append(x)
            continue
        where = device if device is not None else x.device
        hint = torch.empty([max(n, 2) for n in x.shape], dtype=x.dtype, device=where)
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * x.dim())
        fake = mode.from_tensor(hint, symbolic_context=context)
        slots[i] = [size_expr(n) for n in fake.shape]
        values.append(fake)
    return mode, values, slots


def fake_state(gm: fx.GraphModule, mode: Any) -> Any:
    """The graph module's parameters and buffers swapped for fakes for the block: a symbolic run
    must not touch the model's state (BatchNorm's ``num_batches_tracked += 1`` bumped the real
    buffer's version, which the capture's in-place search then took for an update)."""
    from torch.nn.utils.stateless import _reparametrize_module

    tensors = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    return _reparametrize_module(gm, {k: mode.from_tensor(v) for k, v in tensors.items()}, tie_weights=True)


def _regroups(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _REGROUPING


def _sizes(val: Any) -> list[torch.SymInt]:
    """The symbolic sizes a node's value holds: its own (a SymInt) or its tensor's shape."""
    if isinstance(val, torch.SymInt):
        return [val]
    if isinstance(val, torch.Tensor):
        return [s for s in val.shape if isinstance(s, torch.SymInt)]
    return []


def _text(cond: Any) -> str:
    """A guard as Python reads it: ``Mod(x.shape[1], 2) == 0``."""
    if isinstance(cond, sympy.Eq):
        return f"{cond.lhs} == {cond.rhs}"
    if isinstance(cond, sympy.Ne):
        return f"{cond.lhs} != {cond.rhs}"
    return str(cond)


def _conditions(env: Any, symbols: set[str]) -> tuple[Any, ...]:
    """The guards export's shape environment recorded on the inputs' symbols, beyond a symbol's
    range (checked on its own): equalities, divisibility, relations between sizes."""
    if env is None:
        return ()
    out = []
    for guard in env.guards:
        expr = env.replace(guard.expr)
        if expr in (sympy.true, sympy.false) or not {str(x) for x in expr.free_symbols} <= symbols:
            continue
        if expr.is_Relational and len(expr.free_symbols) == 1 and not isinstance(expr, (sympy.Eq, sympy.Ne)) \
                and (expr.lhs.is_Symbol or expr.rhs.is_Symbol) and (expr.lhs.is_number or expr.rhs.is_number):
            continue  # a bound of one symbol: ShapeGuards.ranges
        out.append(expr)
    return tuple(out)
