"""How a mini-batch becomes micro-batches and how their outputs become one result.

A pipeline runs the model on slices of the batch and puts the outputs back together. That
is exact only when each input really has its batch in the dimension that is split and each
output really is per sample in the dimension that is concatenated. Neither is visible in
the code: a sequence-first ``nn.TransformerEncoder`` (input ``(T, B, D)``) split along dim 0
runs fine and is wrong; ``return h, h.mean(0)`` comes back with one mean per micro-batch.

So the user can say it (``chunk_dims=``, ``output_merge=``, in the spirit of
torch.distributed.pipelining's ``args_chunk_spec`` / ``output_merge_spec``), and
:func:`fxpipe.checks._micro_batches.check_split` verifies it when the pipeline is built: the captured graph runs on
the sample once whole and once split, run and merged, and the two must agree, or the
build is refused naming the input or output and the option to set.

Merges: an ``int`` concatenates along that dim (default 0); ``'sum'``; ``'mean'`` (weighted by
micro-batch sizes, so it equals the batch mean of per-sample values even for uneven
splits; a cross entropy mean over counted labels by their counts, :mod:`fxpipe.checks._counted_labels`);
``'first'`` (a value every micro-batch shares); or a callable taking the per-micro-batch values.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..capture._tracing import positional_names
from ._counted_labels import CountedLabels
from ._weighted_mean import weighted_mean
from ..errors import FxpipeError, MicroBatchError
from ..runtime._microbatch import split_sizes as _split_sizes
from ..tree import leaf_names

#: torch's errors of an op given a tensor of the wrong size (a view, reshape or expand)
_SHAPE_ERROR = re.compile(r"\bshape\b|\bsize\b|\bsizes\b", re.IGNORECASE)

__all__ = ["Batching", "Merge", "ChunkDims", "OutputMerge", "MERGES", "input_split_dims"]

Merge = Union[int, str, Callable[[List[Any]], Any]]
ChunkDims = Union[int, Mapping[str, Optional[int]]]
OutputMerge = Union[int, str, Callable[[List[Any]], Any], Mapping[str, Merge]]
MERGES = ("sum", "mean", "first")

_MERGE_CHOICES = "(or 'sum', 'first', a dim to concatenate along, or a callable taking the per-micro-batch values)"


def _merge_hint(name: str) -> str:
    option = f"output_merge={{{name!r}: 'mean'}}" if name else "output_merge='mean'"
    return f"{option} {_MERGE_CHOICES}"


# When a merged loss is the full batch's: said in every refusal that concerns a 0-dim output.
_LOSS_NOTE = (
    "'mean' gives exactly the full batch's value when each micro-batch's value is a mean over as many "
    "items as the others' (a mean over samples of equal-sized micro-batches; uneven sizes are weighted). "
    "A loss fxpipe recognises as a mean over what it counts (F.cross_entropy, F.nll_loss or "
    "nn.CrossEntropyLoss with reduction='mean', as transformers' labels= losses are; a sum divided by a sum "
    "of the inputs, a masked mean) is weighted by each micro-batch's count (its labels that are not "
    "ignore_index, their class weights, its mask's sum), exactly. "
    "Another mean over a varying number of items (an ignore index, padding) is not the full batch's once "
    "merged: return its sum and its count, both merged with 'sum', and divide after the pipeline, or "
    "compute that loss outside the pipeline from the logits.")


def _output_label(name: str) -> str:
    return f"output {name!r}" if name else "the output"


def _argument_names(model: nn.Module, args: tuple, kwargs: dict) -> List[str]:
    """The top-level argument each flat input leaf belongs to: 'x', 'mask', 'args[2]'."""
    positional, var_name = positional_names(model)
    var = var_name or "args"
    names: List[str] = []
    for i, a in enumerate(args):
        name = positional[i] if i < len(positional) else f"{var}[{i - len(positional)}]"
        names += [name] * len(pytree.tree_leaves(a))
    for k, v in kwargs.items():
        names += [k] * len(pytree.tree_leaves(v))
    return names


def input_split_dims(model: nn.Module, args: tuple, kwargs: dict,
                     chunk_dims: ChunkDims = 0) -> Tuple[List[str], List[Optional[int]]]:
    """Per flat input leaf: the argument it belongs to, and the dim it is split along."""
    in_names = _argument_names(model, args, kwargs)
    if isinstance(chunk_dims, int) and not isinstance(chunk_dims, bool):
        in_dims: List[Optional[int]] = [chunk_dims] * len(in_names)
    elif isinstance(chunk_dims, Mapping):
        unknown = sorted(set(chunk_dims) - set(in_names))
        if unknown:
            raise MicroBatchError(f"chunk_dims names {unknown}, which are not arguments of this call; "
                                  f"the arguments are {sorted(set(in_names))}")
        in_dims = [chunk_dims.get(name, 0) for name in in_names]
    else:
        raise MicroBatchError(f"chunk_dims must be an int or a dict {{argument: dim or None}}, got {chunk_dims!r}")
    for name, d in zip(in_names, in_dims):
        if d is not None and (not isinstance(d, int) or isinstance(d, bool)):
            raise MicroBatchError(f"chunk_dims[{name!r}] must be an int dim or None, got {d!r}")
    return in_names, in_dims


def _select(key: str, table: Mapping[str, Any]) -> Tuple[bool, Any]:
    """The entry of ``table`` for leaf ``key``: its own, or its closest container's."""
    parts = key.split(".") if key else [""]
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in table:
            return True, table[prefix]
    return False, None


@dataclass
class Batching:
    """Per flat input leaf the dim it is split along (None: given whole to every micro-batch);
    per flat output leaf how micro-batch values are merged."""

    in_names: List[str]
    in_dims: List[Optional[int]]
    out_names: List[str]
    merges: List[Optional[Merge]]          # None: the default (concatenate along dim 0)
    #: why training mode is refused at call time ('' if it is not): a pipeline built in eval
    #: mode whose training-mode check failed (:mod:`fxpipe.checks._modes`) runs in eval only
    train_refusal: str = ""
    #: how the 0-dim outputs merged by 'mean' are weighed (:mod:`fxpipe.checks._counted_labels`):
    #: found on the captured graph by the first :meth:`check` (None: not looked for)
    counted: Optional[CountedLabels] = None
    #: the micro-batch sizes the build's check ran (:func:`fxpipe.checks._micro_batches.check_split`)
    checked_sizes: List[int] = field(default_factory=list)

    @contextmanager
    def naming_sizes(self, sizes: List[int]) -> Iterator[None]:
        """An error of the model's code on micro-batches smaller than the build checked, said so:
        a shape error (rows grouped by a view, ``scores.view(-1, 4)``, cut by a smaller last
        batch: torch's bare error named a line of stage code, not the sizes nor what to change,
        a trial) as :class:`MicroBatchError`, the model's error as its cause; any other error
        (an index out of range in the data) as it was raised, with a note of the sizes."""
        try:
            yield
        except (FxpipeError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as e:
            if not self.checked_sizes or not sizes or min(sizes) >= min(self.checked_sizes):
                raise
            said = (f"this call's micro-batches hold {sizes} samples; the build checked micro-batches of "
                    f"{self.checked_sizes}")
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            if not (isinstance(e, RuntimeError) and _SHAPE_ERROR.search(first)):
                e.add_note(f"fxpipe: {said}")
                raise
            raise MicroBatchError(
                f"the model fails on micro-batches smaller than the build checked ({type(e).__name__}: {first}): "
                f"{said}. A model that groups its rows (a view over the batch, a reshape to groups) needs "
                "micro-batches that keep whole groups: give a batch size that splits into micro-batches like the "
                "build's, or build with another chunks") from e

    @classmethod
    def build(cls, model: nn.Module, args: tuple, kwargs: dict, out_structure: Any,
              chunk_dims: ChunkDims = 0, output_merge: Optional[OutputMerge] = None) -> "Batching":
        in_names, in_dims = input_split_dims(model, args, kwargs, chunk_dims)
        out_names = leaf_names(out_structure)
        merges: List[Optional[Merge]] = [None] * len(out_names)
        if output_merge is not None:
            table = output_merge if isinstance(output_merge, Mapping) else {"": output_merge}
            for key, merge in table.items():
                _check_merge(key, merge)
            unused = [k for k in table if k and not any(_select(n, {k: 1})[0] for n in out_names)]
            if unused:
                raise MicroBatchError(f"output_merge names {unused}, which are not outputs of the model; "
                                      f"the outputs are {out_names}")
            for i, name in enumerate(out_names):
                found, merge = _select(name, table)
                if not found and "" in table:
                    found, merge = True, table[""]
                merges[i] = merge if found else None
        return cls(in_names, in_dims, out_names, merges)

    # -- splitting -------------------------------------------------------------------------
    def batch_size(self, flat: Sequence[Any]) -> int:
        sizes = {}
        for name, d, x in zip(self.in_names, self.in_dims, flat):
            if isinstance(x, Tensor) and d is not None and x.dim() > 0:
                if not -x.dim() <= d < x.dim():
                    raise MicroBatchError(f"chunk_dims[{name!r}]={d} but {name} has {x.dim()} dims "
                                          f"(shape {tuple(x.shape)})")
                sizes.setdefault(name, x.size(d))
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"{n} has {s}" for n, s in sizes.items())
            raise MicroBatchError(
                f"the inputs split into micro-batches must share one batch size: {listing} "
                "(along the dims of chunk_dims, 0 by default). Give the dim that holds the batch with "
                "chunk_dims={'<argument>': dim}, or None for an argument that is not split.")
        return next(iter(sizes.values()), 0)

    def split(self, flat: Sequence[Any], chunks: int) -> Tuple[List[List[Any]], List[int]]:
        """Per micro-batch the flat input leaves, and the micro-batch sizes (like torch.chunk)."""
        total = self.batch_size(flat)
        sizes = _split_sizes(total, chunks)
        micro: List[List[Any]] = [[] for _ in sizes]
        for d, x in zip(self.in_dims, flat):
            if isinstance(x, Tensor) and d is not None and x.dim() > 0:
                for m, part in zip(micro, x.split(sizes, dim=d)):
                    m.append(part)
            else:
                for m in micro:
                    m.append(x)
        return micro, sizes

    def weights(self, flat: Sequence[Any], micro: Sequence[Sequence[Any]],
                where: str = "this call", alone: bool = True) -> Dict[int, List[Tensor]]:
        """Per 'mean' loss over counted labels, each micro-batch's count of them; refuses ignored
        labels a 'mean' loss cannot weigh (:mod:`fxpipe.checks._counted_labels`). Call before running.
        ``alone=False``: one part of a larger batch, counted even as one micro-batch."""
        if self.counted is None:
            return {}
        return self.counted.weights(flat, micro, self.out_names, self.in_names, where, alone)

    # -- merging ---------------------------------------------------------------------------
    def merge(self, outputs: Sequence[Sequence[Any]], sizes: Sequence[int],
              weights: Optional[Mapping[int, List[Tensor]]] = None) -> List[Any]:
        """Flat output leaves of the mini-batch from each micro-batch's flat outputs
        (``weights``: :meth:`weights` of the same micro-batches)."""
        weights = weights or {}
        return [self._merge_leaf(i, list(column), sizes, weights.get(i)) for i, column in enumerate(zip(*outputs))]

    def _merge_leaf(self, i: int, parts: List[Any], sizes: Sequence[int],
                    counts: Optional[List[Tensor]] = None) -> Any:
        merge = self.merges[i] if i < len(self.merges) else None
        name = self.out_names[i] if i < len(self.out_names) else str(i)
        first = parts[0]
        if merge is None:
            if not isinstance(first, Tensor):
                return first  # checked at build time: equal in every micro-batch
            squeezed = _squeezed(name, parts, sizes)
            if squeezed:
                raise MicroBatchError(squeezed)
            if first.dim() == 0:
                raise MicroBatchError(
                    f"{_output_label(name)} is a 0-dim tensor (a loss, a mean): per micro-batch values cannot "
                    f"be concatenated. Declare how they combine: {_merge_hint(name)}. {_LOSS_NOTE}")
            merge = 0
        if len(parts) == 1:
            return first
        if callable(merge):
            return merge(parts)
        if merge == "first":
            return first
        if merge == "sum":
            return torch.stack(parts).sum(0) if isinstance(first, Tensor) else sum(parts)
        if merge == "mean":
            if counts is not None and isinstance(first, Tensor):  # a mean over counted labels
                return weighted_mean(parts, counts)
            total = sum(sizes)
            if isinstance(first, Tensor):
                if len(set(sizes)) == 1:
                    return torch.stack(parts).mean(0)
                return torch.stack([p * (n / total) for p, n in zip(parts, sizes)]).sum(0)
            return sum(p * n for p, n in zip(parts, sizes)) / total
        dim = int(merge)  # type: ignore[arg-type]
        if isinstance(first, Tensor) and not all(
                isinstance(p, Tensor) and p.dim() == first.dim() and p.shape[:dim] == first.shape[:dim]
                and p.shape[dim + 1:] == first.shape[dim + 1:] for p in parts):
            shapes = [tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__ for p in parts]
            squeezed = _squeezed(name, parts, sizes)
            if squeezed:
                raise MicroBatchError(squeezed)
            raise MicroBatchError(
                f"{_output_label(name)} cannot be concatenated along dim {dim}: the micro-batches gave shapes "
                f"{shapes}, which differ in another dim. A model that trims its output to the batch's longest "
                "sequence (or pads to it) gives each micro-batch its own length, where the whole batch has one. "
                "What to do: pad to a fixed length in the model (or the collator), return a per-sample length "
                "beside the output and trim after the pipeline, or merge this output with a callable "
                f"({_merge_hint(name)}).")
        return torch.cat(parts, dim=dim)

    # -- at call time ----------------------------------------------------------------------
    def refuse_mode(self, training: bool) -> None:
        """At call time: training mode refused when the build's training-mode check failed."""
        if training and self.train_refusal:
            raise MicroBatchError(self.train_refusal)

    def dims_text(self) -> str:
        """'dim 0 of x, mask (not split)': where each input is split, for messages."""
        seen: Dict[str, Optional[int]] = {}
        for n, d in zip(self.in_names, self.in_dims):
            seen.setdefault(n, d)
        return ", ".join(f"dim {d} of {n}" if d is not None else f"{n} (not split)" for n, d in seen.items())

def _check_merge(key: str, merge: Any) -> None:
    ok = callable(merge) or merge in MERGES or (isinstance(merge, int) and not isinstance(merge, bool))
    if not ok:
        raise MicroBatchError(f"output_merge[{key!r}] must be a dim (int), one of {MERGES} or a callable, "
                              f"got {merge!r}")


def _squeezed(name: str, parts: List[Any], sizes: Sequence[int]) -> str:
    """The refusal for an output whose micro-batches of one sample lost a dim the others have
    (``.squeeze()`` without a dim drops a batch of one's batch dim: a trial was told to merge by
    'mean'), or '' when that is not what happened."""
    dims = [p.dim() for p in parts if isinstance(p, Tensor)]
    if len(dims) != len(parts) or len(sizes) != len(parts):
        return ""
    most = max(dims)  # all 0-dim: the build's output had a dim (a 0-dim one needs a declared merge)
    lost = [k for k, d in enumerate(dims) if d < most] or (list(range(len(dims))) if most == 0 else [])
    if not lost or any(sizes[k] != 1 for k in lost):
        return ""
    return (f"{_output_label(name)} has fewer dims for a micro-batch of one sample ({dims} dims for micro-batches of "
            f"{list(sizes)} samples): the model's code drops the batch's dim when it holds one sample -- a .squeeze() "
            "without a dim does -- so a batch split into micro-batches of one (a batch no larger than chunks, a "
            "smaller last batch) comes out otherwise than whole. What to do: name the dim to drop (.squeeze(-1)), "
            "or give every micro-batch two samples or more")
