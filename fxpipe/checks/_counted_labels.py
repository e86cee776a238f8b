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
  sample and on random inputs, :mod:`fxpipe.checks._uncounted`): each sample then divides by its own and
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..errors import MicroBatchError, ModelChangedError
from ._loss_den import nll_total_weight
from ._loss_values import ancestors
from ._uncounted import divisor_of, inputs_program, refuse_divisor, refuse_selection

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
    #: the loss module (``nn.CrossEntropyLoss``, ``nn.NLLLoss``) whose ``ignore_index``, ``weight``
    #: and ``reduction`` are read at each call: it runs its own code, so a change made after the
    #: build reaches its loss (a trial: ``weight`` or ``ignore_index`` set later, 0.03 off)
    module: Optional[nn.Module] = None
    label: str = ""

    def __call__(self, leaves: Sequence[Any]) -> Tensor:
        with torch.no_grad():
            value = self.program(*[leaves[i] for i in self.inputs])
            if self.ignore_index is None:
                return value
            if self.module is not None:
                ignore, weight = self._module_counting()
                return nll_total_weight(value, weight, ignore)
            weight = self.weight() if self.weight is not None else None
            return nll_total_weight(value, weight, self.ignore_index)

    def _module_counting(self) -> Tuple[int, Optional[Tensor]]:
        module = self.module
        if module.reduction != "mean":  # type: ignore[union-attr]
            change = (f"'{self.label}.reduction' is {module.reduction!r}, was 'mean' when the pipeline was built, "  # type: ignore[union-attr]
                      "which merges its loss as a mean over counted labels")
            raise ModelChangedError(
                f"the model changed after the pipeline was built: rebuild it (call fxpipe.pipeline(model, ...) again, "
                f"with the output's merge to match). What changed:\n  - {change}", changes=[change])
        return int(module.ignore_index), module.weight  # type: ignore[union-attr]


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
            refuse_divisor(gm, returned[i], index, in_dims, i, flat)
            refuse_selection(gm, returned[i], index, in_dims, i, flat)
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
    divisor = divisor_of(node)
    if divisor is not None:
        if not _is_sum(_through(node.args[0])) or not _is_sum(_through(divisor)):
            return None
        program = inputs_program(gm, divisor, index)
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
    program = inputs_program(gm, loss[0], index)
    if program is None:
        return None
    module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    return TokenCount(program[0], program[1], loss[1], weight or None, module, str(node.target))


def _through(node: Any) -> Any:
    while isinstance(node, fx.Node) and _passes_on(node):
        node = node.args[0]
    return node


_SUMS = {torch.sum, _aten.sum.default, _aten.sum.dim_IntList}


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


def _fetch(gm: fx.GraphModule, target: str) -> Tensor:
    owner = gm
    *path, name = target.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, name)


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
