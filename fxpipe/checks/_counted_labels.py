"""A loss that is a mean over what it counts: merged exactly, or refused.

``output_merge={'loss': 'mean'}`` weighs each micro-batch's loss by its number of samples. A
mean whose denominator the data decide divides by something else: transformers' ``labels=``
losses skip every ``-100`` (the padding a collator adds, prompt tokens) and, for causal LMs,
the last position of each row (the shift); a class-weighted cross entropy divides by the class
weights of its targets; a masked mean ``(l * mask).sum() / mask.sum()`` by its mask's sum.
Whenever the micro-batches count differently, the size-weighted mean of their means is
another loss with other gradients, and whether they do is only known at call time: a sample
with an all-ones mask or one class passes the build's check and real batches would train
silently wrong.

So the build decides, once, per 0-dim output merged by ``'mean'`` (:meth:`CountedLabels.find`):

* **counted**: the output is, through dtype conversions,
  - the value of a ``cross_entropy`` / ``nll_loss`` with reduction ``'mean'``
    (``F.cross_entropy``, ``F.nll_loss``, ``nn.CrossEntropyLoss``, ``nn.NLLLoss`` under
    torch.fx; ``aten.cross_entropy_loss`` and the ``nll_loss`` ops under torch.export;
    transformers' ``ForCausalLMLoss`` / ``ForMaskedLMLoss`` are these), with any
    ``ignore_index`` and class weights read from the module or an attribute: by definition
    its value is the weighted sum over the targets that are not ignored, divided by their
    class weights' sum (their count without weights); or
  - a sum divided by a sum computed from the inputs alone (``mask.sum()``).
  The graph's own code that makes the target or the divisor from the inputs (transformers'
  pad-and-slice shift, views) is copied out and run on each micro-batch's inputs to count
  them, and :func:`fxpipe.checks._weighted_mean.weighted_mean` merges
  ``sum_i n_i L_i / sum_i n_i``: the whole batch's sum over its count, in value and, since the counts are constants of the merged loss's graph, in
  every gradient.
* **not counted**: any other loss. A loss that divides by a value computed from split inputs
  that is not such a sum (``mask.sum().clamp(min=1)``) is refused at the build, unless that
  value holds one number per sample (``mask.sum(1)`` of a per-sequence mean, shown on the
  sample and on random inputs, :func:`_per_sample`): each sample then divides by its own and
  the split check sees how the samples combine. Before
  anything runs, each call's labels (the integer inputs a loss op reads its target from, with
  that op's ignore index; every integer input split into micro-batches, with ``-100``) are
  checked, and a call holding an ignored label is refused with
  :class:`~fxpipe.errors.MicroBatchError`, as is such a sample at build time.

One micro-batch (``chunks=1``, a batch of one) merges nothing and is never refused.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..errors import MicroBatchError
from ._loss_form import nll_total_weight
from ._loss_values import ancestors

__all__ = ["CountedLabels", "TokenCount", "holds_ignored", "IGNORE_INDEX"]

#: the ignore index of torch's losses and of transformers' labels
IGNORE_INDEX = -100

_aten = torch.ops.aten
_FUNCTIONS: Dict[Any, Callable[..., Any]] = {F.cross_entropy: F.cross_entropy, F.nll_loss: F.nll_loss}
_ATEN_LOSSES = {_aten.cross_entropy_loss.default, _aten.nll_loss.default, _aten.nll_loss_nd.default,
                _aten.nll_loss2d.default}
_ATEN_PAIRS = {_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default}  # (loss, total_weight)
_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)
# What passes a 0-dim loss on unchanged but for its dtype.
_PASS_ATEN = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten.alias.default,
              _aten.clone.default, _aten.contiguous.default}
_PASS_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "clone", "contiguous"}
_MEAN = 1  # at::Reduction::Mean


def holds_ignored(x: Any, ignore: int = IGNORE_INDEX) -> bool:
    """Whether ``x`` is a tensor of labels (integer, with values) holding ``ignore``: floats,
    booleans and meta tensors hold no labels to look at."""
    if (not isinstance(x, Tensor) or x.is_meta or x.is_floating_point() or x.is_complex()
            or x.dtype == torch.bool):
        return False
    return bool((x == ignore).any())


@dataclass
class TokenCount:
    """What a micro-batch's loss divides by: the graph's code for the loss's target (or for
    the divisor itself), run on the micro-batch's inputs (``inputs``: their flat indices).
    With ``ignore_index`` the program gives a cross entropy's target and the count is its
    labels that are not ignored, each weighed by ``weight()`` (its class weights) if any;
    without, the program's value is the count (a mask's sum)."""

    program: fx.GraphModule
    inputs: List[int]
    ignore_index: Optional[int] = None
    weight: Optional[Callable[[], Optional[Tensor]]] = None

    def __call__(self, leaves: Sequence[Any]) -> Tensor:
        with torch.no_grad():
            value = self.program(*[leaves[i] for i in self.inputs])
            if self.ignore_index is None:
                return value
            weight = self.weight() if self.weight is not None else None
            return nll_total_weight(value, weight, self.ignore_index)


@dataclass
class CountedLabels:
    """The build's decision for the ``'mean'``-merged 0-dim outputs (see the module docstring)."""

    #: output index -> how its micro-batches' counted labels are counted
    counts: Dict[int, TokenCount] = field(default_factory=dict)
    #: outputs merged by 'mean' that are not recognised as a mean over counted labels
    uncounted: List[int] = field(default_factory=list)
    #: (flat input index, ignore index) whose presence refuses a call while ``uncounted``
    checks: List[Tuple[int, int]] = field(default_factory=list)

    @classmethod
    def find(cls, gm: fx.GraphModule, whole: Sequence[Any], means: Sequence[bool],
             in_dims: Sequence[Optional[int]], flat: Sequence[Any] = ()) -> "CountedLabels":
        """Looks at the 0-dim floating outputs of ``whole`` (the sample's) whose ``means`` entry
        is set. ``in_dims``: per flat input the dim it is split along (None: not split);
        ``flat``: the sample's inputs (a boolean one is a mask a selection may use)."""
        found = cls()
        wanted = [i for i, (v, m) in enumerate(zip(whole, means))
                  if m and isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point()]
        if not wanted:
            return found
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        output = next((n for n in gm.graph.nodes if n.op == "output"), None)
        returned = output.args[0] if output is not None else None
        if len(placeholders) != len(in_dims) or not isinstance(returned, (tuple, list)) or len(returned) != len(whole):
            returned = [None] * len(whole)  # not the flat layout this reads: nothing is recognised
        index = {p: k for k, p in enumerate(placeholders)}
        for i in wanted:
            try:
                count = _token_count(gm, returned[i], index)
            except Exception:  # noqa: BLE001 - a graph this cannot read: not recognised, so guarded
                count = None
            if count is None:
                found.uncounted.append(i)
            else:
                found.counts[i] = count
        for i in found.uncounted:
            _refuse_divisor(gm, returned[i], index, in_dims, i, flat)
            _refuse_selection(gm, returned[i], index, in_dims, i, flat)
        if found.uncounted:
            checks = {(k, IGNORE_INDEX) for k, d in enumerate(in_dims) if d is not None}
            for node in gm.graph.nodes:
                loss = _loss_call(gm, node)
                if loss is not None and isinstance(loss[0], fx.Node):
                    checks |= {(index[p], loss[1]) for p in ancestors(loss[0]) if p in index}
            found.checks = sorted(checks)
        return found

    def weights(self, leaves: Sequence[Any], micro: Sequence[Sequence[Any]], out_names: Sequence[str],
                in_names: Sequence[str], where: str = "this call", alone: bool = True) -> Dict[int, List[Tensor]]:
        """Per counted output, each micro-batch's count of counted labels (0-dim tensors, no
        sync); refuses ``where`` (the call, or the sample) before anything runs when an
        uncounted output would merge micro-batches whose labels hold an ignore index.
        ``alone=False``: the call is a part of a larger batch (a data-parallel replica's), so
        even one micro-batch is counted, its count weighed against the others' parts."""
        if len(micro) < 2 and alone:
            return {}
        if self.uncounted:
            self._refuse_ignored(leaves, out_names, in_names, where)
        return {i: [count(m) for m in micro] for i, count in self.counts.items()}

    def _refuse_ignored(self, leaves: Sequence[Any], out_names: Sequence[str], in_names: Sequence[str],
                        where: str) -> None:
        for k, ignore in self.checks:
            if holds_ignored(leaves[k] if k < len(leaves) else None, ignore):
                names = [repr(out_names[i]) for i in self.uncounted]
                outputs = (("the output is" if not out_names[self.uncounted[0]] else f"output {names[0]} is")
                           if len(names) == 1 else f"outputs {', '.join(names)} are")
                raise MicroBatchError(
                    f"argument {in_names[k]!r} holds {ignore} (an ignored label) in {where}, and {outputs} merged "
                    "over micro-batches with 'mean'. fxpipe weighs a loss by each micro-batch's count of counted "
                    "labels only where it recognises it as a mean over them (F.cross_entropy, F.nll_loss or "
                    "nn.CrossEntropyLoss with reduction='mean', as transformers' labels= losses are, or a sum "
                    "divided by a sum of the inputs). This loss is not one: with micro-batches that count different numbers of "
                    "labels, the merged loss and its gradients would silently differ from the model's. What to "
                    "do: return the loss's sum and its number of counted labels, merge both with 'sum' (e.g. "
                    "output_merge={'loss_sum': 'sum', 'count': 'sum'}) and divide after the pipeline; or compute "
                    "the loss outside the pipeline from the logits. A loss already divided by the whole batch's "
                    "count, given to every micro-batch whole (transformers' num_items_in_batch), is a sum of its "
                    "micro-batches' parts: merge it with 'sum'.")


def _token_count(gm: fx.GraphModule, node: Any, index: Dict[fx.Node, int]) -> Optional[TokenCount]:
    """The counting of the loss ``node`` returns, or None when it is not a mean over what
    its code counts: a cross entropy / nll_loss mean (class weights included), or a sum
    divided by a sum computed from the inputs alone (a masked mean)."""
    while isinstance(node, fx.Node) and _passes_on(node):
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    divisor = _divisor(node)
    if divisor is not None:
        if not _is_sum(_through(node.args[0])) or not _is_sum(_through(divisor)):
            return None
        program = _program(gm, divisor, index)
        return None if program is None or not program[1] else TokenCount(program[0], program[1])
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
            and isinstance(node.args[0], fx.Node) and node.args[0].target in _ATEN_PAIRS:
        node = node.args[0]
    loss = _loss_call(gm, node)
    if loss is None or not loss[2] or not isinstance(loss[0], fx.Node):
        return None
    weight = _weight_of(gm, loss[3])
    if weight is False:
        return None
    program = _program(gm, loss[0], index)
    if program is None:
        return None
    return TokenCount(program[0], program[1], loss[1], weight or None)


def _through(node: Any) -> Any:
    while isinstance(node, fx.Node) and _passes_on(node):
        node = node.args[0]
    return node


_DIVIDES = {operator.truediv, torch.div, torch.true_divide, _aten.div.Tensor}
_SUMS = {torch.sum, _aten.sum.default, _aten.sum.dim_IntList}


def _divisor(node: fx.Node) -> Optional[fx.Node]:
    """``b`` of ``a / b`` (any spelling) when ``b`` is a node, else None."""
    divides = ((node.op == "call_function" and node.target in _DIVIDES and not node.kwargs.get("rounding_mode"))
               or (node.op == "call_method" and node.target in ("div", "true_divide", "__truediv__")))
    if divides and len(node.args) == 2 and isinstance(node.args[1], fx.Node):
        return node.args[1]
    return None


def _is_sum(node: Any) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in _SUMS)
                                          or (node.op == "call_method" and node.target == "sum"))


def _weight_of(gm: fx.GraphModule, weight: Any) -> Any:
    """A cross entropy's class weights, read at each call: None (no weights), a function
    returning the tensor the graph reads, or False when this cannot tell which tensor."""
    if weight is None:
        return None
    if isinstance(weight, Tensor):  # a module's own weight (nn.CrossEntropyLoss(weight=...))
        return lambda: weight
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        target = str(weight.target)
        return lambda: _fetch(gm, target)
    return False


_COMPARISONS = {"ne", "eq", "lt", "le", "gt", "ge", "__ne__", "__eq__", "__lt__", "__le__", "__gt__", "__ge__",
                "logical_and", "logical_or", "logical_not", "__and__", "__or__", "__invert__", "bool", "isfinite",
                "isnan", "isinf"}
_SELECTIONS = {"masked_select", "nanmean", "nonzero", "nansum"}


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", ""))


def _refuse_selection(gm: fx.GraphModule, node: Any, index: Dict[fx.Node, int], in_dims: Sequence[Optional[int]],
                      i: int, flat: Sequence[Any] = ()) -> None:
    """An uncounted 'mean' loss over a selection the data decide (``l[labels != pad].mean()``,
    ``masked_select``, ``nanmean``): each micro-batch would divide by its own count, silently;
    refused at the build with the exact spelling (a masked mean fxpipe weighs)."""
    if not isinstance(node, fx.Node):
        return
    split = {p for p, k in index.items() if in_dims[k] is not None}
    masks = {p for p, k in index.items() if k < len(flat) and isinstance(flat[k], Tensor) and flat[k].dtype == torch.bool}

    def boolean(key: Any) -> bool:  # a comparison, or computed from a boolean input (a mask)
        return isinstance(key, fx.Node) and (_op_name(key) in _COMPARISONS or bool(ancestors(key) & masks))

    for n in ancestors(node):
        name = _op_name(n)
        chosen = None
        if name in _SELECTIONS:
            chosen = n
        elif n.op == "call_function" and n.target is operator.getitem and len(n.args) > 1:
            keys = n.args[1] if isinstance(n.args[1], (tuple, list)) else (n.args[1],)
            if any(boolean(k) for k in keys):
                chosen = n
        if chosen is not None and ancestors(chosen) & split:
            where = _line(chosen)
            raise MicroBatchError(
                f"the loss (output {i}, merged with 'mean') averages over a selection the data decide "
                f"({chosen.name}{where}: a boolean mask, masked_select or nanmean): each micro-batch would divide by "
                "its own count, and the merged loss and its gradients would silently differ from the model's. What "
                "to do: write it as a masked mean, (l * mask).sum() / mask.sum(), which fxpipe weighs by each "
                "micro-batch's mask sum, exactly; or return the sum and the count merged with 'sum'.")


def _line(node: fx.Node) -> str:
    """`` (the source line)`` the capture recorded for ``node``, or ''."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return f" ({trace[-1].strip()})" if trace else ""


_SIZE_READS = {"size", "numel", "dim", "shape"}


def _is_size_read(n: fx.Node) -> bool:
    """``x.size(0)``, ``x.shape``, ``x.numel()``: a node giving a tensor's shape, not its values."""
    return ((n.op == "call_method" and n.target in _SIZE_READS)
            or (n.op == "call_function" and (n.target is getattr and n.args[1:] == ("shape",)
                                             or n.target in (_aten.sym_size.int, _aten.sym_numel.default))))


def _values_read(node: fx.Node) -> Set[fx.Node]:
    """The nodes whose *values* ``node`` is computed from: its ancestors, not followed through
    a read of a shape (``x.size(0)`` depends on the size of ``x`` only)."""
    return ancestors(node, lambda n: [] if _is_size_read(n) else n.all_input_nodes) - \
        {n for n in ancestors(node) if _is_size_read(n)}


def _fetch(gm: fx.GraphModule, target: str) -> Tensor:
    owner = gm
    *path, name = target.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, name)


def _refuse_divisor(gm: fx.GraphModule, node: Any, index: Dict[fx.Node, int], in_dims: Sequence[Optional[int]],
                    i: int, flat: Sequence[Any] = ()) -> None:
    """An uncounted 'mean' loss that divides by a value computed from inputs split into
    micro-batches (a count of the data this could not read as one): refused at the build,
    since each micro-batch would divide by its own. A divisor every micro-batch gets whole (a
    0-dim ``num_items_in_batch``, as transformers' Trainer passes; a temperature) is not refused
    here: whether 'mean' or 'sum' merges the loss exactly is then the split check's to see on
    the sample (:func:`fxpipe.checks._micro_batches.check_split`)."""
    if not isinstance(node, fx.Node):
        return

    def split(k: int) -> bool:  # Batching.split passes a 0-dim tensor whole
        x = flat[k] if k < len(flat) else None
        return in_dims[k] is not None and not (isinstance(x, Tensor) and x.dim() == 0)

    for n in ancestors(node):
        divisor = _divisor(n)
        if divisor is None:
            continue
        program = _program(gm, divisor, index)
        read = [index[p] for p in _values_read(divisor) if p in index]
        if program is None or not any(split(k) for k in read):
            continue  # a constant, an input given whole, or a size (x.size(0): the size-weighted merge is its mean)
        if _per_sample(program[0], program[1], in_dims, flat):
            continue  # each sample divided by its own count (a per-sequence mean): the merge is the samples'
        where = _line(n)
        raise MicroBatchError(
            f"the loss (output {i}, merged with 'mean') divides by {divisor.name}{where}, a value computed from "
            f"the inputs that is not a sum fxpipe can weigh (e.g. a count under .clamp(min=1)): each micro-batch "
            "would divide by its own, and the merged loss and its gradients would silently differ from the "
            "model's. What to do: divide by the plain sum (mask.sum()) and guard an empty batch outside the "
            "model, or return the loss's sum and its count and merge both with 'sum' "
            "(output_merge={'loss_sum': 'sum', 'count': 'sum'}), dividing after the pipeline.")


def _per_sample(program: fx.GraphModule, inputs: Sequence[int], in_dims: Sequence[Optional[int]],
                flat: Sequence[Any]) -> bool:
    """Whether the divisor ``program`` computes holds one value per sample (``mask.sum(1)`` of
    a per-sequence mean): run on the inputs split in two, its parts concatenate to its value on
    the whole, on the sample and on random inputs of the sample's shapes and dtypes (a sample's
    all-ones mask would let ``mask.sum(1) + mask.sum() - mask.numel()`` pass)."""
    if any(k >= len(flat) for k in inputs):
        return False
    g = torch.Generator().manual_seed(0)

    def drawn(x: Any) -> Any:
        if not isinstance(x, Tensor) or x.numel() == 0:
            return x
        if x.dtype == torch.bool:
            return torch.rand(x.shape, generator=g) < 0.5
        if x.is_floating_point():
            return torch.randn(x.shape, generator=g).to(x.dtype)
        low, high = int(x.min()), int(x.max())
        return torch.randint(low, high + 1, x.shape, generator=g).to(x.dtype)

    sample = [flat[k] for k in inputs]
    try:
        with torch.no_grad():
            for xs in (sample, [drawn(x).to(x.device) if isinstance(x, Tensor) else x for x in sample]):
                whole = program(*xs)
                halves = [[torch.tensor_split(x, 2, dim=in_dims[k])[h]
                           if isinstance(x, Tensor) and in_dims[k] is not None and x.dim() > 0 else x
                           for x, k in zip(xs, inputs)] for h in (0, 1)]
                parts = [program(*half) for half in halves]
                if not isinstance(whole, Tensor) or whole.dim() == 0 or not any(
                        torch.equal(whole, torch.cat(parts, dim=d)) for d in range(whole.dim())
                        if all(p.dim() == whole.dim() and p.shape[:d] == whole.shape[:d]
                               and p.shape[d + 1:] == whole.shape[d + 1:] for p in parts)
                        and sum(p.shape[d] for p in parts) == whole.shape[d]):
                    return False
    except Exception:  # noqa: BLE001 - a divisor that cannot run split is not shown per sample
        return False
    return True


def _passes_on(node: fx.Node) -> bool:
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_function":
        return node.target in _PASS_ATEN
    return node.op == "call_method" and node.target in _PASS_METHODS


def _loss_call(gm: fx.GraphModule, node: fx.Node) -> Optional[Tuple[Any, int, bool, Any]]:
    """``(target, ignore_index, mean, weight)`` of a cross_entropy / nll_loss node, else None.
    Mean: reduction 'mean', which divides by the class weights of the targets that are not
    ignored (their count without weights); ``weight``: the class weights' node, tensor or None."""
    try:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if not isinstance(module, _MODULES):
                return None
            target = node.args[1] if len(node.args) > 1 else node.kwargs.get("target")
            return target, int(module.ignore_index), module.reduction == "mean", module.weight
        if node.op != "call_function":
            return None
        if node.target in _FUNCTIONS:
            bound = inspect.signature(_FUNCTIONS[node.target]).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            a = bound.arguments
            mean = a["reduction"] == "mean" and a["size_average"] is None and a["reduce"] is None
            return a["target"], int(a["ignore_index"]), mean, a["weight"]
        if node.target in _ATEN_LOSSES or node.target in _ATEN_PAIRS:
            a = _schema_arguments(node)
            return a["target"], int(a["ignore_index"]), a["reduction"] == _MEAN, a["weight"]
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    return None


def _schema_arguments(node: fx.Node) -> Dict[str, Any]:
    """An aten call's arguments by name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: Dict[str, Any] = {}
    for k, arg in enumerate(schema.arguments):
        if k < len(node.args):
            out[arg.name] = node.args[k]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _program(gm: fx.GraphModule, target: fx.Node,
             index: Dict[fx.Node, int]) -> Optional[Tuple[fx.GraphModule, List[int]]]:
    """The graph's code computing ``target`` from the inputs, as a GraphModule of its own, and
    the flat indices of the inputs it takes; None when it calls a module (its cost and state
    are not the label bookkeeping this runs per call) or reads anything but inputs and constants.
    A move to another tensor's device (``labels.to(logits.device)``, transformers' losses) is
    left out: counting runs where the labels are, and needs nothing of the logits."""
    needed = ancestors(target, lambda n: [n.args[0]] if _moves_device(n) else n.all_input_nodes)
    if any(n.op not in ("placeholder", "call_function", "call_method", "get_attr") for n in needed):
        return None
    if any(n.op == "placeholder" and n not in index for n in needed):
        return None
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    inputs: List[int] = []
    for n in gm.graph.nodes:  # topological: every argument is copied before its user
        if n in needed:
            env[n] = env[n.args[0]] if _moves_device(n) else graph.node_copy(n, lambda a: env[a])
            if n.op == "placeholder":
                inputs.append(index[n])
    graph.output(env[target])
    return fx.GraphModule(gm, graph), inputs


def _moves_device(node: fx.Node) -> bool:
    """``x.to(y.device)``: a node whose only other argument is another node's ``.device``."""
    if node.op != "call_method" or node.target != "to" or len(node.args) != 2 or node.kwargs:
        return False
    device = node.args[1]
    return (isinstance(node.args[0], fx.Node) and isinstance(device, fx.Node) and device.op == "call_function"
            and device.target is getattr and device.args[1:] == ("device",))
