"""The abstract values of a loss's reading (:mod:`fxpipe.checks._loss_form`) and the facts
about aten ops it reads them by.

A node's :class:`Form` says how its value relates to the samples of the batch: per-sample
``rows`` (each slice along one dim belongs to one sample), a ``total`` (a sum over the
samples), a ``ratio`` (such a sum over a count, :class:`Den`), ``free`` (no sample's), a
``count`` (a number proportional to the samples), or ``bad`` with the reason, which names
the op and the line of the loss it came from (:func:`source_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx

__all__ = ["VIEWS", "Den", "Form", "LossForm", "ancestors", "bad", "source_of", "recorded_line", "shape_of", "numel", "op_name", "raw_name", "in_place",
           "is_pointwise", "FREE", "ROWS", "TOTAL", "RATIO", "COUNT", "BAD", "LINEAR", "SCAN_OR_REDUCE", "FILLS",
           "REDUCING_LOSSES", "NLL", "RANDOM", "ELEMENTWISE"]

FREE, ROWS, TOTAL, RATIO, COUNT, BAD = "free", "rows", "total", "ratio", "count", "bad"


#: ops whose result shares its argument's memory: a write into one reaches the argument
VIEWS = {"slice", "select", "narrow", "as_strided", "diagonal", "unfold", "view", "_unsafe_view", "reshape",
          "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "alias"}

@dataclass(frozen=True)
class Den:
    """What a ``ratio`` divides by: ``'size'`` (proportional to the number of samples) or
    ``'data'`` (the value of ``node``, computed from the target alone)."""

    kind: str
    node: Optional[fx.Node] = None
    #: a small constant the count has added (``mask.sum() + 1e-8``, against a division by 0):
    #: each micro-batch's count then holds it once, negligible only against counts much larger
    shift: float = 0.0


@dataclass(frozen=True)
class Form:
    """The abstract value of one node (see the module docstring)."""

    kind: str
    grad: bool = False          # depends differentiably on the model's output
    output: bool = False        # depends on the model's output at all
    dim: int = 0                # rows: the dim that holds the samples
    block: Tuple[int, int] = (1, 1)  # rows: (outer, inner): index = (o * m + sample) * inner + i
    uniform: bool = False       # free: one value everywhere (may broadcast along the samples)
    den: Optional[Den] = None   # ratio
    also: Tuple[Den, ...] = ()  # ratio: the other terms' counts (a sum of means), proportional or refused per call
    shift: float = 0.0          # total: a small constant added to a count of the target (see Den.shift)
    why: str = ""               # bad


@dataclass
class LossForm:
    """The reading of a whole loss: ``kind`` ``'sum'`` or ``'mean'`` (a ratio over ``den``),
    or None with ``why`` it is not proven."""

    kind: Optional[str]
    den: Optional[Den] = None
    #: a sum of means over other counts: exact when every micro-batch's counts are proportional
    also: Tuple[Den, ...] = ()
    why: str = ""


def bad(why: str) -> Form:
    """A form that is no reading, saying why."""
    return Form(BAD, why=why)


def recorded_line(node: fx.Node) -> str:
    """`` (the source line)`` the capture recorded last for ``node``, or '': for a refusal's
    message."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return f" ({trace[-1].strip()})" if trace else ""


def source_of(node: fx.Node) -> str:
    """The op, and the user's source line where the trace recorded it."""
    name = op_name(node) if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ") and "/torch/" not in ln
              and "/fxpipe/" not in ln]
    if frames:
        k = frames[-1]
        code = lines[k + 1] if k + 1 < len(lines) else ""
        found = re.match(r'File "(.*)", line (\d+), in (.*)', lines[k])
        at = f"{found.group(1)}:{found.group(2)} in {found.group(3)}" if found else lines[k][5:]
        return f"{name} at {at}: `{code}`"
    return name


def shape_of(node: Any) -> Optional[Tuple[int, ...]]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, Tensor) else None


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- the ops, by kind ---------------------------------------------------------------------
LINEAR = {"add", "sub", "rsub", "mul", "div", "neg", "_to_copy", "clone", "alias", "detach", "to", "contiguous",
           "lift_fresh_copy", "positive"}
SCAN_OR_REDUCE = {"amax", "amin", "max", "min", "logsumexp", "prod", "var", "std", "var_mean", "std_mean",
                   "linalg_vector_norm", "norm", "any", "all", "argmax", "argmin", "cumsum", "cumprod", "_softmax",
                   "_log_softmax", "sort", "topk", "median", "kthvalue", "logcumsumexp", "cummax", "cummin",
                   "aminmax", "nansum", "count_nonzero", "flip", "roll"}
FILLS = {"full", "zeros", "ones", "empty", "scalar_tensor", "zeros_like", "ones_like", "full_like", "empty_like",
          "new_zeros", "new_ones", "new_full", "new_empty"}
#: loss ops taking ``reduction`` (0 none, 1 mean, 2 sum) at this position; their tensor arguments are pointwise
REDUCING_LOSSES = {"mse_loss": 2, "binary_cross_entropy": 3, "binary_cross_entropy_with_logits": 4,
                    "smooth_l1_loss": 2, "huber_loss": 2, "soft_margin_loss": 2, "l1_loss": 2,
                    "multilabel_margin_loss": 2, "multi_margin_loss": 5}
NLL = {"nll_loss_forward", "nll_loss2d_forward"}
RANDOM = {"rand", "randn", "randint", "bernoulli", "native_dropout", "normal", "uniform", "rand_like", "randn_like",
           "multinomial", "randperm", "exponential"}


def raw_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def in_place(node: fx.Node) -> bool:
    raw = raw_name(node)
    return isinstance(node.target, torch._ops.OpOverload) and raw.endswith("_") and not raw.endswith("__")


def op_name(node: fx.Node) -> str:
    """The op's name, an in-place variant's (``add_``) as its out-of-place one's."""
    return raw_name(node)[:-1] if in_place(node) else raw_name(node)


#: elementwise ops whose schema carries no pointwise tag
ELEMENTWISE = {"masked_fill", "where", "clamp", "clamp_min", "clamp_max", "nan_to_num", "logical_not", "sign"}


def is_pointwise(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or op_name(node) in LINEAR or op_name(node) in ELEMENTWISE


def ancestors(node: fx.Node, inputs_of: Optional[Callable[[fx.Node], List[fx.Node]]] = None) -> Set[fx.Node]:
    """``node`` and every node it is computed from (``inputs_of``: which of a node's inputs to
    follow; default all)."""
    seen: Set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(inputs_of(n) if inputs_of is not None else n.all_input_nodes)
    return seen
