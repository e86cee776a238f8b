"""How a mini-batch becomes micro-batches and how their outputs become one result.

A pipeline runs the model on slices of the batch and puts the outputs back together. That
is exact only when each input really has its batch in the dimension that is split and each
output really is per sample in the dimension that is concatenated. Neither is visible in
the code: a sequence-first ``nn.TransformerEncoder`` (input ``(T, B, D)``) split along dim 0
runs fine and is wrong; ``return h, h.mean(0)`` comes back with one mean per micro-batch.

So the user can say it (``chunk_dims=``, ``output_merge=``, in the spirit of
torch.distributed.pipelining's ``args_chunk_spec`` / ``output_merge_spec``), and
:meth:`Batching.check` verifies it when the pipeline is built: the captured graph runs on
the sample once whole and once split, run and merged, and the two must agree, or the
build is refused naming the input or output and the option to set.

Merges: an ``int`` concatenates along that dim (default 0); ``'sum'``; ``'mean'`` (weighted by
micro-batch sizes, so it equals the batch mean of per-sample values even for uneven
splits; a cross entropy mean over counted labels by their counts, :mod:`fxpipe.checks.counted_labels`);
``'first'`` (a value every micro-batch shares); or a callable taking the per-micro-batch values.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..capture.tracing import positional_names
from .counted_labels import CountedLabels, weighted_mean
from ..errors import MicroBatchError
from .loss import gradient_mismatch
from ..capture.values import exactly_same, same_value
from ..runtime.microbatch import split_sizes as _split_sizes
from ..tree import leaf_names

__all__ = ["SAMPLE_SEED", "Batching", "Merge", "ChunkDims", "OutputMerge", "MERGES", "input_split_dims", "evaluating",
           "concatenated_dim"]

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
    "A loss fxpipe recognises as a mean over counted labels (F.cross_entropy, F.nll_loss or "
    "nn.CrossEntropyLoss with reduction='mean' and no class weights, as transformers' labels= losses are) "
    "is weighted by each micro-batch's number of labels that are not ignore_index (-100 labels), exactly. "
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


#: the seed of :meth:`Batching.sample_run` (:mod:`fxpipe.runtime.randomness` compares against it)
SAMPLE_SEED = 0


@dataclass
class Batching:
    """Per flat input leaf the dim it is split along (None: given whole to every micro-batch);
    per flat output leaf how micro-batch values are merged."""

    in_names: List[str]
    in_dims: List[Optional[int]]
    out_names: List[str]
    merges: List[Optional[Merge]]          # None: the default (concatenate along dim 0)
    #: why training mode is refused at call time ('' if it is not): a pipeline built in eval
    #: mode whose training-mode check failed (:mod:`fxpipe.checks.modes`) runs in eval only
    train_refusal: str = ""
    #: how the 0-dim outputs merged by 'mean' are weighed (:mod:`fxpipe.checks.counted_labels`):
    #: found on the captured graph by the first :meth:`check` (None: not looked for)
    counted: Optional[CountedLabels] = None

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
                where: str = "this call") -> Dict[int, List[Tensor]]:
        """Per 'mean' loss over counted labels, each micro-batch's count of them; refuses ignored
        labels a 'mean' loss cannot weigh (:mod:`fxpipe.checks.counted_labels`). Call before running."""
        if self.counted is None:
            return {}
        return self.counted.weights(flat, micro, self.out_names, self.in_names, where)

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
        return torch.cat(parts, dim=int(merge))  # type: ignore[arg-type]

    # -- the build-time check --------------------------------------------------------------
    def refuse_mode(self, training: bool) -> None:
        """At call time: training mode refused when the build's training-mode check failed."""
        if training and self.train_refusal:
            raise MicroBatchError(self.train_refusal)

    def check(self, gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any], whole: Sequence[Any], *,
              mode: Optional[Callable[[nn.Module], Any]] = None, values: bool = True,
              blame: Optional[Callable[[List[List[Any]]], str]] = None, why: str = "", mode_text: str = "",
              random: Optional[bool] = None) -> bool:
        """Runs ``gm`` split on the sample and compares with ``whole`` (:func:`sample_run`, in
        the same ``mode``); refuses when the results differ.

        Two micro-batches (uneven when the batch is odd) are enough to see a wrong split
        dim or an output that is not per sample. Runs under ``mode(model)`` (default: eval
        mode; :mod:`fxpipe.checks.modes` runs the training mode too) and under no_grad; the
        caller restores the model's state. A graph that gives another result with another
        seed (random ops the mode does not switch off) is checked for structure only, as is
        everything with ``values=False``. ``blame(micro)`` says which module differs first
        ('' when unknown); ``why`` replaces the generic advice of a refusal, ``mode_text``
        (' in training mode') says which mode differed. ``random=False`` says the whole run
        drew no random numbers from torch (:func:`fxpipe.runtime.randomness.drew_random`): the second, reseeded run
        is then made only before refusing on a value difference. Returns whether the graph is
        deterministic on the sample.
        """
        mode = mode or evaluating
        if self.counted is None:
            self.counted = CountedLabels.find(gm, whole, [m == "mean" for m in self.merges], self.in_dims)
        deterministic = True if random is False else self.reruns_same(gm, model, flat, whole, mode)
        provisional = random is False  # not yet confirmed by a second run
        compare = deterministic and values
        total = self.batch_size(flat)
        if total < 2:
            return deterministic
        k = 2
        with mode(model), torch.no_grad():
            micro, sizes = self.split(flat, k)
            weights = self.weights(flat, micro, "the sample")  # decided as for a call
            try:
                outs = [list(gm(*m)) for m in micro]
            except Exception as e:  # noqa: BLE001 - the split inputs are what broke it
                raise MicroBatchError(
                    f"the model fails on a micro-batch ({type(e).__name__}: {str(e).strip().splitlines()[0]}). "
                    f"The inputs are split along {self._dims_text()}; if the batch is in another dim of an "
                    "input, say so with chunk_dims={'<argument>': dim} (None for an argument that must not "
                    "be split).") from e
        for i, (a, column) in enumerate(zip(whole, zip(*outs))):  # in output order
            b = self._merge_leaf(i, list(column), sizes, weights.get(i))
            if compare and provisional and not same_value(a, b):
                provisional = False
                deterministic = self.reruns_same(gm, model, flat, whole, mode)
                compare = deterministic and values
            if not same_value(a, b, values=compare):
                found = blame(micro) if blame is not None and compare else ""
                self._refuse(i, a, b, list(column), k, found, why, mode_text)
        reduced = [i for i, a in enumerate(whole) if isinstance(a, Tensor) and a.dim() == 0
                   and a.is_floating_point() and self.merges[i] is not None]
        if compare and reduced:  # a merged loss: its gradient must be the batch's too
            with mode(model):
                torch.manual_seed(1)
                bad = gradient_mismatch(gm, flat, micro, reduced,
                                        lambda i, parts: self._merge_leaf(i, parts, sizes, weights.get(i)))
            if bad is not None and provisional and not self.reruns_same(gm, model, flat, whole, mode):
                bad, deterministic = None, False  # random after all: values are not compared
            if bad is not None:
                i, param, diff, scale = bad
                raise MicroBatchError(
                    f"{_output_label(self.out_names[i])} merged over {k} micro-batches is close to the full "
                    f"batch's value but its gradient is not the full batch's: the gradient of parameter '{param}' differs by up to "
                    f"{diff:.3g} (largest |gradient| {scale:.3g}). Training the pipeline would silently "
                    f"differ from the model. {_LOSS_NOTE}")
        return deterministic

    @staticmethod
    def reruns_same(gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any], whole: Sequence[Any],
                    mode: Callable[[nn.Module], Any]) -> bool:
        """Whether ``gm`` gives ``whole`` again with another seed (no randomness left in ``mode``)."""
        with mode(model), torch.no_grad():
            torch.manual_seed(1)
            again = list(gm(*flat))
        return all(exactly_same(a, b) for a, b in zip(whole, again))

    @staticmethod
    def sample_run(run: Callable[[], Any], model: nn.Module,
                   mode: Optional[Callable[[nn.Module], Any]] = None) -> Any:
        """``run()`` on the whole sample under ``mode(model)`` (default eval), no_grad, seeded (see check)."""
        with (mode or evaluating)(model), torch.no_grad():
            torch.manual_seed(SAMPLE_SEED)
            return run()

    def _dims_text(self) -> str:
        seen: Dict[str, Optional[int]] = {}
        for n, d in zip(self.in_names, self.in_dims):
            seen.setdefault(n, d)
        return ", ".join(f"dim {d} of {n}" if d is not None else f"{n} (not split)" for n, d in seen.items())

    def _refuse(self, i: int, whole: Any, merged: Any, parts: List[Any], k: int, found: str, why: str,
                mode_text: str) -> None:
        name = self.out_names[i]
        if isinstance(whole, Tensor) and isinstance(merged, Tensor):
            if whole.shape != merged.shape:
                what = f"has shape {tuple(whole.shape)} for the whole batch but {tuple(merged.shape)} merged"
            else:
                diff = (whole.double() - merged.double()).abs().max().item()
                what = f"differs by up to {diff:.3g} (largest |value| {whole.double().abs().max().item():.3g})"
        else:
            what = f"is {_short(whole)} for the whole batch but {_short(merged)} merged"
        head = (f"{_output_label(name)} {what} when the sample is split into {k} micro-batches along "
                f"{self._dims_text()} and the outputs are merged{mode_text}")
        found = f" {found}" if found else ""
        if why:
            raise MicroBatchError(f"{head}{why}{found}")
        dim = concatenated_dim(whole, parts)
        current = self.merges[i] if self.merges[i] is not None else 0
        if dim is not None and dim != current:  # the shapes say where the batch is: verified, not guessed
            option = f"output_merge={{{name!r}: {dim}}}" if name else f"output_merge={dim}"
            raise MicroBatchError(
                f"{head}.{found} Each micro-batch's output has its batch in dim {dim}: concatenated along "
                f"dim {dim} they give the model's output exactly. What to do: pass {option} (a "
                "sequence-first model split with chunk_dims=1 usually needs output_merge=1).")
        raise MicroBatchError(
            f"{head}. A pipeline would silently differ from the "
            f"model.{found} What to do: if the batch is not in those dims, give it with chunk_dims={{'<argument>': "
            f"dim}}; if this output is not per sample, declare its merge with {_merge_hint(name)}."
            + (f" {_LOSS_NOTE}" if isinstance(whole, Tensor) and whole.dim() == 0 else ""))


def concatenated_dim(whole: Any, parts: Sequence[Any]) -> Optional[int]:
    """The dim along which ``parts`` concatenate to ``whole`` (value included), or None."""
    if not isinstance(whole, Tensor) or not all(isinstance(p, Tensor) for p in parts) or len(parts) < 2:
        return None
    for d in range(whole.dim()):
        if all(p.dim() == whole.dim() and p.shape[:d] == whole.shape[:d] and p.shape[d + 1:] == whole.shape[d + 1:]
               for p in parts) and sum(p.shape[d] for p in parts) == whole.shape[d]:
            return d if same_value(whole, torch.cat(list(parts), dim=d)) else None
    return None


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block; every submodule's own flag is put back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _check_merge(key: str, merge: Any) -> None:
    ok = callable(merge) or merge in MERGES or (isinstance(merge, int) and not isinstance(merge, bool))
    if not ok:
        raise MicroBatchError(f"output_merge[{key!r}] must be a dim (int), one of {MERGES} or a callable, "
                              f"got {merge!r}")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
