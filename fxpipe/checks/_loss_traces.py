"""One loss traced at several batch sizes, compared node by node (no values).

:mod:`fxpipe.checks._loss_fn` traces ``loss_fn`` with ``make_fx`` on fake tensors at a
micro-batch's size ``m``, at ``m + 1`` and at the whole batch's size. Comparing the traces tells
the numbers that follow the batch size (a count: ``/ out.size(0)``) from literals (``/ 4``), and
refuses code whose ops change with the batch size (``if len(y) >= 4``). A trace at one sample
differs from the others only in layout: a slice of one sample is contiguous, so it views where
the others copy and view (:func:`aligned`).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx

from ._loss_values import source_of

__all__ = ["count_args", "aligned"]


def count_args(traces: Sequence[Tuple[fx.GraphModule, int]]) -> Tuple[Optional[Set[Tuple[int, int]]], str]:
    """The plain numbers (and one-element tensor constants) of ``traces[0]`` that follow the
    batch size: ``(node index, arg position)``, position ``-1`` for a ``get_attr`` constant.
    ``traces``: the same loss traced at several batch sizes ``(graph, samples)``. A number
    that changes must be proportional to the samples in every trace (a count); None and why
    when the graphs differ in structure (code that branches on the batch size) or a number
    changes otherwise (``B - 1``, ``max(B, 4)``). Shapes given as lists are not compared: the
    reading follows shapes itself."""
    (base, m), others = traces[0], traces[1:]
    a = list(base.graph.nodes)
    found: Set[Tuple[int, int]] = set()
    for other, size in others:
        b = list(other.graph.nodes)
        pairs_of = aligned(base, other, layout=size == 1)
        if pairs_of is None:
            return None, f"its code depends on the batch size (batches of {m} and {size} samples trace different ops)"
        for i, j in pairs_of:
            x, y = a[i], b[j]
            pairs: List[Tuple[int, Any, Any]] = []
            if x.op == "call_function":
                pairs = [(k, u, v) for k, (u, v) in enumerate(zip(x.args, y.args))
                         if isinstance(u, (int, float)) and not isinstance(u, bool)]
            elif x.op == "get_attr":
                u, v = _constant(base, x.target), _constant(other, y.target)
                weight = u is v and isinstance(u, torch.nn.Parameter)
                if isinstance(u, Tensor) and isinstance(v, Tensor) and not weight:
                    # (a parameter the loss reads is one tensor in every trace: no number of the batch; it
                    # may be on meta or a shard, whose values torch cannot compare)
                    if u.shape != v.shape or (u.numel() > 1 and not torch.equal(u, v)):
                        return None, "it makes a tensor constant that depends on the batch size"
                    if u.numel() == 1 and not (u.is_meta or v.is_meta):
                        try:
                            pairs = [(-1, float(u), float(v))]
                        except Exception:  # noqa: BLE001 - no value to read (a shard's, a fake's): not a count
                            pairs = []
            for k, u, v in pairs:
                if u == v:
                    continue
                if u != 0 and u * size == v * m:
                    found.add((i, k))
                else:
                    return None, (f"{source_of(x)} uses a number that changes with the batch size but is not "
                                  "proportional to it (like B - 1, max(B, 4))")
    return found, ""


#: ops that only change a tensor's layout: a slice of one sample is contiguous where a slice
#: of several is not, so the trace at 1 sample views where the others clone and view
_COPIES = {"aten.clone.default", "aten.contiguous.default"}
_VIEWS = {"aten._unsafe_view.default": "aten.view.default", "aten.reshape.default": "aten.view.default"}


def aligned(a: fx.GraphModule, b: fx.GraphModule, layout: bool = False) -> Optional[List[Tuple[int, int]]]:
    """Index pairs of ``a``'s and ``b``'s nodes doing the same op in the same order, or None
    where the graphs differ. ``layout``: ``b`` was traced at one sample, where copies that
    only make a tensor contiguous are not needed: those are skipped, and views matched to
    reshapes."""
    def ops(gm: fx.GraphModule) -> List[Tuple[int, Any, str]]:
        found = []
        for i, n in enumerate(gm.graph.nodes):
            name = str(n.target)
            if layout and n.op == "call_function" and name in _COPIES:
                continue
            found.append((i, n.op, _VIEWS.get(name, name) if layout else name))
        return found

    x, y = ops(a), ops(b)
    if len(x) != len(y) or any(u[1:] != v[1:] for u, v in zip(x, y)):
        return None
    return [(u[0], v[0]) for u, v in zip(x, y)]


def _constant(gm: fx.GraphModule, target: Any) -> Any:
    owner: Any = gm
    for part in str(target).split("."):
        owner = getattr(owner, part, None)
    return owner
