"""A user's ``loss_fn`` read, not trusted: each micro-batch's weight in the step's loss.

``pipe.step(loss_fn=...)`` (and ``fxpipe.distributed``'s steps) compute ``loss_fn`` on each
micro-batch's output and must combine the ``L_i`` into the loss ``loss_fn`` gives on the whole
batch. Whether that is a sum, a mean weighted by sizes, by counted tokens, by a mask's sum or
by the class weights of the targets, or impossible (an in-batch-negatives loss), is read off
``loss_fn``'s own aten graph (:mod:`fxpipe.checks._loss_form`), traced on fake tensors
(``make_fx``; no data is computed) shaped like one micro-batch's output and target.

Each distinct micro-batch shape is traced three times (at ``m`` and ``m + 1`` samples:
numbers that follow the batch size, like ``/ out.size(0)``, are told from literals; and at the
whole batch's size, where code that branches on ``len(y)`` or a reshape that mixes samples
would read otherwise) and the reading is cached per shape and per :func:`loss_key`, at most
:data:`CACHE` shapes (about 0.1 s per new shape on a CPU, about one GPT-2 step at the test
sizes; the first trace of a process also pays torch's fake-tensor and dynamo imports, 2-4 s).
Per call, a ``'data'`` count (a token count, a mask's sum, the targets' class weights) is
computed from each micro-batch's target by the graph's own code for it, copied out: no
forward, no logits (about 1% of a step, ``benchmarks/loss_reading.py``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from ._loss_den import den_program
from ._loss_form import Den, LossForm, read_loss
from ._loss_state import kept
from ._loss_traces import aligned, count_args

__all__ = ["LossFnReading", "Weights", "CACHE", "out_dims_of", "own_loss_output"]

#: micro-batch shapes whose reading is kept per loss_fn
CACHE = 32


@dataclass
class Weights:
    """How a call's micro-batch losses merge: ``kind`` ``'sum'`` (``sum_i L_i``) or
    ``'mean'`` (``sum_i n_i L_i / sum_i n_i``, ``counts`` the ``n_i``); None with ``why``."""

    kind: Optional[str]
    counts: Optional[List[Tensor]] = None
    why: str = ""
    #: a loss adding means over several counts: each further count's sum over the call's
    #: micro-batches against the first's (proportional in every micro-batch, so one number
    #: each), which the parts of a larger batch (data-parallel replicas) must share too
    ratios: Tuple[float, ...] = ()
    #: a count is the micro-batches' samples, standing for what the loss divides by (a mean over
    #: every position): proportional within one call, not between calls of other shapes
    by_samples: bool = False

    def merge(self, parts: Sequence[Tensor]) -> Tensor:
        from ._weighted_mean import weighted_mean
        if self.kind == "sum":
            return torch.stack(list(parts)).sum(0)
        assert self.counts is not None
        return weighted_mean(parts, self.counts)


@dataclass
class _Read:
    """A reading at one shape: the form, and per count it divides by (``form.den`` then
    ``form.also``) its program (None: proportional to the samples)."""

    form: LossForm
    programs: List[Optional[Tuple[Callable[..., Tensor], List[int]]]] = field(default_factory=list)
    #: per count: whether it is a cross entropy's (whose sum is 0 where it counts nothing)
    nll: List[bool] = field(default_factory=list)


def own_loss_output(batching: Any, who: str, todo: str) -> int:
    """The flat output index of the model's own loss: the one 0-dim output merged with
    ``'mean'`` or ``'sum'`` (named ``loss`` where several are), for both front doors; a
    :class:`~fxpipe.errors.StepError` otherwise, saying ``who`` trains it and what to do."""
    from ..errors import StepError

    names, merges = batching.out_names, batching.merges
    linear = [i for i, merge in enumerate(merges) if isinstance(merge, str) and merge in ("mean", "sum")]
    if len(linear) > 1:
        linear = [i for i in linear if names[i] == "loss"] or linear
    if len(linear) != 1:
        found = "no output" if not linear else f"outputs {[names[i] for i in linear]}"
        raise StepError(
            f"{who} trains the model's own loss: the one 0-dim output merged with 'mean' or 'sum' "
            f"(output_merge={{'loss': 'mean'}}), and {found} of this model {'is' if not linear else 'are'} merged "
            f"so. {todo}, or build with output_merge naming the loss output")
    return linear[0]


def out_dims_of(merges: Sequence[Any]) -> List[Optional[int]]:
    """Per flat output leaf, the dim holding the samples, from its merge (``Batching.merges``):
    concatenated along a dim (None: dim 0), or not per sample (summed, averaged, first)."""
    return [0 if mg is None else mg if isinstance(mg, int) and not isinstance(mg, bool) else None for mg in merges]


def _proportional(a: Sequence[Tensor], b: Sequence[Tensor], eps: float) -> bool:
    """Whether ``a_i / sum(a) == b_i / sum(b)`` for every micro-batch, to the rounding of the
    dtype the counts were computed in (``eps``): two sums of the same class weights in another
    order (a weighted cross entropy's mean and its label smoothing's) differ in their last
    float32 bits."""
    x, y = torch.stack(list(a)).double(), torch.stack(list(b)).double()
    return bool(torch.allclose(x * y.sum(), y * x.sum(), rtol=max(64 * eps, 1e-12), atol=0.0))


def _den_kinds(form: LossForm) -> Tuple[Any, ...]:
    return tuple(d.kind for d in (form.den, *form.also) if d is not None)


def _is_nll(node: Any) -> bool:
    return isinstance(node, fx.Node) and "nll_loss" in str(node.target)


def _key(leaves: Sequence[Any]) -> Tuple[Any, ...]:
    return tuple((tuple(x.shape), x.dtype, x.device.type) if isinstance(x, Tensor) else ("v", repr(x))
                 for x in leaves)


class LossFnReading:
    """``loss_fn`` of one pipeline, read per micro-batch shape.

    Args:
        loss_fn: ``loss_fn(output)`` or ``loss_fn(output, target)`` on one micro-batch.
        out_dims: per flat output leaf, the dim holding the samples (None: not per sample).
        unflatten: flat output leaves -> the model's output structure.
    """

    def __init__(self, loss_fn: Callable[..., Tensor], out_dims: Sequence[Optional[int]],
                 unflatten: Callable[[List[Any]], Any]) -> None:
        self.loss_fn = loss_fn
        self.out_dims = list(out_dims)
        self.unflatten = unflatten
        self._cache: "OrderedDict[Tuple[Any, ...], _Read]" = OrderedDict()
        #: the trainable parameters loss_fn reads (a temperature, a penalty's weight), by id:
        #: ``fxpipe.distributed`` refuses those its rank's stages do not hold
        self.parameters: dict = {}

    def weights(self, outputs: Sequence[Any], targets: Optional[Sequence[Any]], sizes: Sequence[int],
                device: Optional[torch.device] = None, alone: bool = True) -> Weights:
        """The weights of a call whose micro-batches have ``sizes`` samples, ``targets`` (None
        without a target) and, for the first, the flat ``outputs`` (the others' differ only in
        the samples' dim; meta tensors do, with ``device`` saying where they would be).
        ``alone=False``: the call is one part of a larger batch (a data-parallel replica's):
        even one micro-batch's count is read, to be weighed against the other parts'."""
        stand_ins = {m: self._resized(outputs, m, device) for m in set(sizes)}
        by_size: dict = {}  # micro-batches of one size are split from one batch: one reading
        for i, m in enumerate(sizes):
            if m not in by_size:
                by_size[m] = self._read(stand_ins[m], None if targets is None else targets[i], m, sum(sizes))
        reads = [by_size[m] for m in sizes]
        bad = next((r.form for r in reads if r.form.kind is None), None)
        if bad is not None:
            return Weights(None, why=bad.why)
        forms = {(r.form.kind, tuple(p is None for p in r.programs)) for r in reads}
        if len(forms) != 1:
            return Weights(None, why="loss_fn reads differently at the call's micro-batch sizes")
        kind = reads[0].form.kind
        if kind == "sum" or (len(sizes) == 1 and alone):
            return Weights("sum" if kind == "sum" else "mean", counts=[torch.ones((), dtype=torch.float64)])
        per_count: List[List[Tensor]] = []  # per count the loss divides by, per micro-batch
        by_samples = False
        eps = 0.0  # the rounding of the dtype the counts were computed in
        for k in range(len(reads[0].programs)):
            column = []
            for i, (m, r) in enumerate(zip(sizes, reads)):
                found = r.programs[k]
                if found is None:  # proportional to the samples
                    column.append(torch.tensor(float(m), dtype=torch.float64))
                    by_samples = True
                    continue
                program, used = found
                leaves = self._leaves(stand_ins[m], None if targets is None else targets[i])
                with torch.no_grad():
                    value = program(*[leaves[j] for j in used])
                if value.is_floating_point():
                    eps = max(eps, torch.finfo(value.dtype).eps)
                column.append(value.to(torch.float64))
            per_count.append(column)
        counts = per_count[0]
        shift = max((abs(d.shift) for r in reads for d in (r.form.den, *r.form.also) if d is not None), default=0.0)
        if shift and (len(counts) - 1) * shift > torch.finfo(torch.float32).eps * abs(float(sum(counts))):
            # each micro-batch's count holds the constant once: k - 1 extra, negligible or not proven
            return Weights(None, why=(
                f"loss_fn adds {shift:g} to the count it divides by, which each of the {len(counts)} micro-batches "
                f"would add once: against this call's count of {float(sum(counts)):g} that is more than float32 "
                "rounding"))
        empty = [i for i, c in enumerate(counts) if not bool(c != 0)]
        # a micro-batch every count of which is 0 adds nothing: weighed 0, never backwarded
        # (runtime/_orders, distributed/_loss); one count 0 among others would need its numerator
        partly = [i for i in empty if any(bool(column[i] != 0) for column in per_count[1:])]
        if partly and not all(all(r.nll) for r in reads):
            # L_i = N_i / 0: the weighted merge would need N_i, which a nan or inf no longer holds
            # (a cross entropy's N_i is 0 then, and its backward gives zeros: exact)
            return Weights(None, why=f"micro-batch {partly[0]} counts nothing in one of the means loss_fn adds "
                                     "(it divides that one by 0), so its loss holds no value to weigh")
        for other in per_count[1:]:
            if not _proportional(counts, other, eps):
                return Weights(None, why=(
                    "loss_fn adds means over counts that differ between this call's micro-batches (per micro-batch "
                    f"{[round(float(c), 4) for c in counts]} against {[round(float(c), 4) for c in other]}): no "
                    "one weight per micro-batch gives every term its whole-batch mean"))
        first = float(sum(counts))
        ratios = tuple(float(sum(other)) / first if first else math.inf for other in per_count[1:])
        return Weights("mean", counts=counts, ratios=ratios, by_samples=by_samples)

    # -- reading ---------------------------------------------------------------------------
    def _dims(self, n: int) -> List[Optional[int]]:
        """The samples' dim of each of ``n`` flat outputs: the merges name the model's output
        leaves, and a transformers cache taken apart adds leaves merged along dim 0."""
        return self.out_dims[:n] + [0] * (n - len(self.out_dims))

    def _resized(self, outputs: Sequence[Any], m: int, device: Optional[torch.device]) -> List[Any]:
        """Stand-ins for the flat outputs of a micro-batch of ``m`` samples (meta tensors that
        remember the device the outputs are on)."""
        out = []
        for x, d in zip(outputs, self._dims(len(outputs))):
            if isinstance(x, Tensor):
                shape = list(x.shape)
                if d is not None and x.dim() > 0:
                    shape[d] = m
                out.append(torch.empty(shape, dtype=x.dtype, device="meta", requires_grad=x.requires_grad))
                out[-1]._fxpipe_device = device if x.is_meta and device is not None else x.device  # type: ignore
            else:
                out.append(x)
        return out

    def _leaves(self, outputs: Sequence[Any], target: Any) -> List[Any]:
        tensors = [x for x in outputs if isinstance(x, Tensor)]
        if target is not None:
            tensors += [t for t in pytree.tree_leaves(target) if isinstance(t, Tensor)]
        return tensors

    def _read(self, outputs: List[Any], target: Any, m: int, whole: int) -> _Read:
        key = (_key(outputs), _key(pytree.tree_leaves(target)) if target is not None else None, m, whole)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        read = self._trace_and_read(outputs, target, m, whole)
        self._cache[key] = read
        if len(self._cache) > CACHE:
            self._cache.popitem(last=False)
        return read

    def _trace_and_read(self, outputs: List[Any], target: Any, m: int, whole: int) -> _Read:
        """Traces at ``m`` samples (the counts' code is taken from there), ``m + 1`` (numbers
        that follow the batch size), and the whole batch's ``whole`` (code that changes with
        the batch size, reshapes that mix samples only at that size): all must read alike."""
        sizes = sorted({m, m + 1, whole})
        traces = {}
        try:
            for n in sizes:
                with kept(self.loss_fn) as state:  # what it keeps between calls put back after each
                    traces[n] = self._trace(outputs, target, m, n)
                if state.state:
                    return _Read(LossForm(None, why=(
                        f"loss_fn changes state it keeps between calls ({', '.join(state.state[:3])}: a step "
                        "counter, a running statistic): called once per micro-batch, it would change it once per "
                        "micro-batch, not once per step. Keep that state outside loss_fn (update it from the loss "
                        "pipe.step returns)")))
        except Exception as e:  # noqa: BLE001 - not proven: merged-output loss (GPipe) or a typed refusal
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return _Read(LossForm(None, why=f"loss_fn could not be run on fake tensors shaped like micro-batches of "
                                            f"{m} and {m + 1} samples and the batch of {whole} "
                                            f"({type(e).__name__}: {first})"))
        for trace in traces.values():
            for node in trace.graph.nodes:
                read = getattr(trace, str(node.target), None) if node.op == "get_attr" else None
                if isinstance(read, torch.nn.Parameter) and read.requires_grad:
                    self.parameters[id(read)] = read
        base = sizes[1] if m < 2 else m  # the reading's trace: 2 samples or more
        counts, why = count_args([(traces[base], base)] + [(traces[n], n) for n in sizes if n != base])
        if counts is None:
            return _Read(LossForm(None, why=why))
        n_out = sum(isinstance(x, Tensor) for x in outputs)
        dims = [d if x.dim() > 0 else None for x, d in zip(outputs, self._dims(len(outputs))) if isinstance(x, Tensor)]
        targets = [t for t in pytree.tree_leaves(target) if isinstance(t, Tensor)] if target is not None else []
        inputs = [(d, True) for d in dims] + [((0 if t.dim() > 0 else None), False) for t in targets]
        assert len(inputs) >= n_out
        forms = [read_loss(traces[n], inputs, n, counts) for n in sizes if n >= 2]
        form = forms[0]
        if any(f.kind != form.kind or _den_kinds(f) != _den_kinds(form) for f in forms[1:]):
            bad = next((f for f in forms if f.kind is None), None)
            return _Read(bad if bad is not None else LossForm(
                None, why="loss_fn reads differently at the micro-batches' size and the whole batch's"))
        graph, small = traces[base], traces[m]  # the reading's nodes; the trace at the true size
        if form.kind != "mean" or form.den is None:
            return _Read(form)
        read = _Read(form)
        for den in (form.den, *form.also):
            if den.kind != "data":
                read.programs.append(None)
                read.nll.append(False)
                continue
            # the count's node, in the trace at the true size (the same ops in the same order)
            where = dict(aligned(graph, small, layout=m == 1) or ())
            node = list(small.graph.nodes)[where[list(graph.graph.nodes).index(den.node)]]
            read.programs.append(den_program(small, Den("data", node)))
            read.nll.append(_is_nll(node))
        return read

    def _trace(self, outputs: List[Any], target: Any, m: int, at: int) -> fx.GraphModule:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        flat_target, spec = pytree.tree_flatten(target) if target is not None else ([], None)
        with mode:
            fake_out = [self._fake(x, d, at) for x, d in zip(outputs, self._dims(len(outputs)))]
            fake_target = [torch.empty(_at(t.shape, 0, at), dtype=t.dtype, device=t.device)
                           if isinstance(t, Tensor) and t.dim() > 0 else t for t in flat_target]
        tensors = [x for x in fake_out if isinstance(x, Tensor)] + [t for t in fake_target if isinstance(t, Tensor)]
        loss_fn, unflatten = self.loss_fn, self.unflatten
        unflatten(list(fake_out))  # fxpipe's own structure: an error here is not loss_fn's

        def traced(*xs: Tensor) -> Tensor:
            pending = list(xs)
            # outputs as the loss gets them, computed (not leaves): an in-place edit of the logits
            # (`out.logits[..., pad] = -1e4`) failed the reading as an in-place op on a leaf (a trial)
            leaves = [(lambda t: t.clone() if t.requires_grad else t)(pending.pop(0)) if isinstance(x, Tensor) else x
                      for x in fake_out]
            target_leaves = [pending.pop(0) if isinstance(t, Tensor) else t for t in fake_target]
            output = unflatten(leaves)
            if spec is None:
                return loss_fn(output)
            return loss_fn(output, pytree.tree_unflatten(target_leaves, spec))

        _anchor(loss_fn)
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # a loss that fails on fake tensors is a reading, not a log entry
        try:
            return make_fx(traced, tracing_mode="fake", record_stack_traces=True)(*tensors)
        finally:
            quiet.setLevel(level)

    def _fake(self, x: Any, d: Optional[int], at: int) -> Any:
        if not isinstance(x, Tensor):
            return x
        device = getattr(x, "_fxpipe_device", x.device)
        shape = list(x.shape)
        if d is not None and x.dim() > 0:
            shape[d] = at
        return torch.empty(shape, dtype=x.dtype, device=device, requires_grad=x.requires_grad)


def _anchor(loss_fn: Any) -> None:
    """Asks torch.fx to record ``loss_fn``'s own source lines on the traced nodes (it keeps
    only frames of ``forward`` methods otherwise), for refusals that name the line."""
    from torch.fx import proxy

    register = getattr(proxy, "_register_stack_trace_anchor", None)  # torch >= 2.10; else ops are named alone
    if register is not None and getattr(loss_fn, "__code__", None) is not None:
        register(loss_fn)


def _at(shape: Sequence[int], dim: int, size: int) -> List[int]:
    out = list(shape)
    out[dim] = size
    return out
