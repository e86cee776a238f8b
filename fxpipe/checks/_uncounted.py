"""'mean' losses in the model that fxpipe cannot count, refused at the build.

:mod:`fxpipe.checks._counted_labels` weighs a ``'mean'`` loss by what it divides by where it
reads that as a count (a cross entropy's labels, a mask's sum). Any other loss whose divisor
the data decide would be merged by sizes while each micro-batch divides by its own count:
silently wrong on real batches, though a sample with an all-ones mask passes the numeric
check. Two such forms are refused here, naming the source line: a division by a value
computed from split inputs (``mask.sum().clamp(min=1)``) unless it holds one value per sample
(a per-sequence mean), and a mean over a selection the data decide (``l[mask].mean()``).
The graph's own code computing a value from the inputs (:func:`inputs_program`) is shared
with the counting.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx

from ..capture._values import concatenated_dim
from ..errors import MicroBatchError
from ._loss_values import ancestors, recorded_line

__all__ = ["divisor_of", "inputs_program", "refuse_divisor", "refuse_selection"]

_aten = torch.ops.aten

_DIVIDES = {operator.truediv, torch.div, torch.true_divide, _aten.div.Tensor}
def divisor_of(node: fx.Node) -> Optional[fx.Node]:
    """``b`` of ``a / b`` (any spelling) when ``b`` is a node, else None."""
    divides = ((node.op == "call_function" and node.target in _DIVIDES and not node.kwargs.get("rounding_mode"))
               or (node.op == "call_method" and node.target in ("div", "true_divide", "__truediv__")))
    if divides and len(node.args) == 2 and isinstance(node.args[1], fx.Node):
        return node.args[1]
    return None


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


def refuse_selection(gm: fx.GraphModule, node: Any, index: Dict[fx.Node, int], in_dims: Sequence[Optional[int]],
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
            where = recorded_line(chosen)
            raise MicroBatchError(
                f"the loss (output {i}, merged with 'mean') averages over a selection the data decide "
                f"({chosen.name}{where}: a boolean mask, masked_select or nanmean): each micro-batch would divide by "
                "its own count, and the merged loss and its gradients would silently differ from the model's. What "
                "to do: write it as a masked mean, (l * mask).sum() / mask.sum(), which fxpipe weighs by each "
                "micro-batch's mask sum, exactly; or return the sum and the count merged with 'sum'.")


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


def refuse_divisor(gm: fx.GraphModule, node: Any, index: Dict[fx.Node, int], in_dims: Sequence[Optional[int]],
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
        divisor = divisor_of(n)
        if divisor is None:
            continue
        program = inputs_program(gm, divisor, index)
        read = [index[p] for p in _values_read(divisor) if p in index]
        if program is None or not any(split(k) for k in read):
            continue  # a constant, an input given whole, or a size (x.size(0): the size-weighted merge is its mean)
        if _per_sample(program[0], program[1], in_dims, flat):
            continue  # each sample divided by its own count (a per-sequence mean): the merge is the samples'
        where = recorded_line(n)
        raise MicroBatchError(
            f"the loss (output {i}, merged with 'mean') divides by {divisor.name}{where}, a value computed from "
            f"the inputs, and fxpipe does not read the loss as a sum over the samples divided by a plain sum of "
            f"the inputs (a count under .clamp(min=1), or a numerator it does not read as such a sum: "
            f"cross_entropy(reduction='sum') is one it does not): each micro-batch "
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
                per_sample = isinstance(whole, Tensor) and whole.dim() > 0
                if not per_sample or concatenated_dim(whole, parts, exact=True) is None:
                    return False
    except Exception:  # noqa: BLE001 - a divisor that cannot run split is not shown per sample
        return False
    return True


def inputs_program(gm: fx.GraphModule, target: fx.Node,
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
