"""A running total over the batch's samples that a threshold then decides on: refused.

GShard/Switch-style token dropping counts each token's slot in its expert's queue with a
running total over the whole flattened batch, ``slot = onehot.cumsum(0)``, and keeps the tokens
with ``slot <= capacity``. Each sample's result then depends on the samples before it. On the
build's sample no expert overflows, so the whole batch and the merged micro-batches agree and
the build's check passes; a later batch whose routing is skewed overflows differently per
micro-batch than over the whole batch (a trial: 0.185 off, magnitude 0.82, silently). Scaling
the sample's values (:mod:`._stressed`) did not make it overflow.

So the rule is read from the graph, not the sample: a cumulative op (``cumsum``, ``cumprod``,
``cummax``, ``cummin``, ``logcumsumexp``) along a dim that holds the batch, whose result reaches
a comparison or a clamp within a few ops, is refused with more than one micro-batch. Which dims
hold the batch is measured: the graph runs twice under a ``FakeTensorMode`` (no compute), at the
sample's batch and at twice it, and a dim whose size changed holds the batch. A running total
along a sample's own dims (positions from ``attention_mask.cumsum(-1)``, Switch Transformers'
per-sample queue) is not; one whose result is only used as offsets or positions (``cu_seqlens``,
packing samples into one buffer, a dropless MoE's dispatch slot picked by ``torch.where``) reaches
no threshold and stays (a review: such a dispatch was refused when ``where`` counted as one). Graphs without a cumulative op pay nothing; a graph that cannot run on
fakes (an op needing values) makes no claim here.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from torch import fx

from ..capture._shape_guards import fake_state
from ..capture._user_code import source_location
from ..errors import MicroBatchError
from ._loss_values import raw_name

__all__ = ["refuse_running_totals"]

_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "cumsum_"}
#: ops that decide on a value: a comparison, a clamp, an order (``where`` and ``masked_fill``
#: decide only through their condition or mask: see :func:`_decided_on`)
_THRESHOLDS = {"lt", "le", "gt", "ge", "eq", "ne", "less", "less_equal", "greater", "greater_equal",
               "clamp", "clamp_max", "clamp_min", "clip", "minimum", "maximum",
               "lt_", "le_", "gt_", "ge_", "clamp_", "topk", "sort", "argsort"}
#: ops that select by a condition: (name, the condition's argument position)
_SELECTIONS = {"where": 0, "masked_fill": 1, "masked_fill_": 1}
_OPERATORS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne}
#: how many ops after the running total a threshold may come (``(slot > 0) & (slot <= cap)``: 1)
_HOPS = 4


class _Done(Exception):
    """Every suspect's size is read: the fake run stops there."""


def _cumulative(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and raw_name(node) in _CUMULATIVE


def _decided_on(node: fx.Node) -> bool:
    """Whether ``node``'s value reaches a comparison or clamp within :data:`_HOPS` ops."""
    frontier, seen = [node], {node}
    for _ in range(_HOPS):
        following: List[fx.Node] = []
        for n in frontier:
            for user in n.users:
                if user in seen or user.op == "output":
                    continue
                if user.op in ("call_function", "call_method") and (
                        user.target in _OPERATORS or raw_name(user) in _THRESHOLDS):
                    return True
                at = _SELECTIONS.get(raw_name(user)) if user.op in ("call_function", "call_method") else None
                if at is not None:
                    if len(user.args) > at and user.args[at] is n:
                        return True  # the running total is the condition
                    continue  # a value selected (packed positions, a dispatch slot): not decided on
                seen.add(user)
                following.append(user)
        frontier = following
    return False


def _dim(node: fx.Node) -> Optional[int]:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return dim if isinstance(dim, int) else None


def refuse_running_totals(gm: fx.GraphModule, flat: Sequence[Any], split_dims: Sequence[Optional[int]],
                          chunks: int) -> None:
    """Raises :class:`MicroBatchError` for a running total along the batch that a threshold
    decides on (see the module docstring), where ``chunks`` micro-batches would each count their
    own. ``split_dims``: per flat input, its batch dim (None: not split)."""
    if chunks < 2:
        return
    suspects = [n for n in gm.graph.nodes if _cumulative(n) and _dim(n) is not None and _decided_on(n)]
    if not suspects:
        return
    first = _extents(gm, flat, split_dims, suspects, 1)
    second = _extents(gm, flat, split_dims, suspects, 2)
    if first is None or second is None:
        return
    for n in suspects:
        if n.name in first and first[n.name] != second.get(n.name):
            where = source_location(n) or f"node {n.name!r}"
            raise MicroBatchError(
                f"{where}: `{raw_name(n)}` along dim {_dim(n)} is a running total over the batch's "
                f"samples (that dim's size grows with the batch), and a threshold decides on it (a comparison or a clamp "
                f"follows): each sample's result depends on the samples before it in the batch. The build's check "
                f"agrees on this sample, but a pipeline counts per micro-batch, and once a later batch crosses the "
                f"threshold (an expert's capacity: tokens with slot <= capacity kept) its result silently differs "
                f"from the model's. What to do: count per sample (a running total along a dim within each sample, "
                f"after reshaping to (batch, ...)), or build with chunks=1.")


def _extents(gm: fx.GraphModule, flat: Sequence[Any], split_dims: Sequence[Optional[int]],
             suspects: List[fx.Node], factor: int) -> Optional[Dict[str, int]]:
    """Each suspect's input size along its dim, with the batch ``factor`` times the sample's,
    run on fakes; None where the graph cannot run so."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wanted: Set[fx.Node] = set(suspects)
    seen: Dict[str, int] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class _Sizes(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n in wanted:
                value = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
                dim = _dim(n)
                if isinstance(value, torch.Tensor) and dim is not None and -value.dim() <= dim < value.dim():
                    seen[n.name] = int(value.shape[dim])
                wanted.discard(n)
                if not wanted:
                    raise _Done  # the rest of the graph tells nothing more
            return super().run_node(n)

    inputs = []
    for x, split in zip(flat, list(split_dims) + [None] * (len(flat) - len(split_dims))):
        if isinstance(x, torch.Tensor):
            shape = list(x.shape)
            if split is not None and x.dim() > split:
                shape[split] *= factor
            with mode:  # made fake, nothing allocated
                x = torch.empty(shape, dtype=x.dtype, device=x.device)
        inputs.append(x)
    try:
        with mode, torch.no_grad(), fake_state(gm, mode):
            _Sizes(gm).run(*inputs)
    except _Done:
        pass
    except Exception:  # noqa: BLE001 - an op needing values (nonzero, .item()): no claim
        return None
    return seen
