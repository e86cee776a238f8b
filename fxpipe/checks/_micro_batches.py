"""The build-time check that a model's micro-batches give its own result.

The captured graph runs on the sample once whole and once split into two micro-batches,
run and merged by the :class:`~fxpipe.checks._batching.Batching` policy; the two must agree
(values, and a merged loss's gradient), or the build is refused naming the input or output
and the option to set (``chunk_dims=``, ``output_merge=``). :mod:`fxpipe.checks._modes` runs it
in eval and in training mode.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn

from ..capture._mode_flags import modes_kept
from ..capture._mutation import MUTATES_STATE
from ..capture._prepare import written_kept
from ..capture._tracing import Capture
from ..capture._values import concatenated_dim, exactly_same, same_value
from ..errors import MicroBatchError
from ._batching import _LOSS_NOTE, Batching, _merge_hint, _output_label
from ..runtime._microbatch import split_sizes
from ._counted_labels import CountedLabels
from ._data_swaps import DataSwaps
from ._backward_mixing import unseen_backward
from ._loss import NUDGE, gradient_mismatch, nudged

__all__ = ["SAMPLE_SEED", "check_split", "check_merged_gradients", "micro_batch_count", "reruns_same", "sample_run",
           "eager_run", "evaluating", "concatenated_dim", "state_kept"]

#: the seed of :func:`sample_run` (:func:`fxpipe.runtime._randomness.drew_random` compares against it)
SAMPLE_SEED = 0


def check_split(batching: Batching, gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any], whole: Sequence[Any], *,
          mode: Optional[Callable[[nn.Module], Any]] = None, values: bool = True,
          blame: Optional[Callable[[List[List[Any]]], str]] = None, why: str = "", mode_text: str = "",
          random: Optional[bool] = None, nudge: bool = True, chunks: int = 2) -> bool:
    """Runs ``gm`` split on the sample and compares with ``whole`` (:func:`sample_run`, in
    the same ``mode``); refuses when the results differ.

    The sample is split as the pipeline will split it, into ``chunks`` micro-batches (at least
    two, uneven when the batch does not divide): two are enough to see a wrong split dim or an
    output that is not per sample, but not a mixing that depends on which samples share a
    micro-batch (a batch trimmed to its longest sequence: exact in halves that each hold a
    longest one, 0.067 off in the quarters ``chunks=4`` made, a trial). Micro-batches keep two
    samples at least where the sample allows: a sample of ``chunks`` samples built from would
    otherwise be checked one sample at a time (BatchNorm1d fails on one, a ``.squeeze()`` drops
    its batch), which calls of a larger batch never run. Runs under ``mode(model)`` (default: eval
    mode; :mod:`fxpipe.checks._modes` runs the training mode too) and under no_grad; the
    caller restores the model's state. A graph that gives another result with another
    seed (random ops the mode does not switch off) is checked for structure only, as is
    everything with ``values=False``. ``blame(micro)`` says which module differs first
    ('' when unknown); ``why`` replaces the generic advice of a refusal, ``mode_text``
    (' in training mode') says which mode differed. ``random=False`` says the whole run
    drew no random numbers from torch (:func:`fxpipe.runtime._randomness.drew_random`): the second, reseeded run
    is then made only before refusing on a value difference. ``nudge``: the checks made once per
    build, in the first mode checked (the forward again at nudged weights, the merged loss's and
    backward code's gradients: the same in either mode once dropout is off). Returns whether the
    graph is deterministic on the sample.
    """
    mode = mode or evaluating
    if batching.counted is None:
        batching.counted = CountedLabels.find(gm, whole, [m == "mean" for m in batching.merges], batching.in_dims,
                                              flat)
    deterministic = True if random is False else reruns_same(gm, model, flat, whole, mode)
    provisional = random is False  # not yet confirmed by a second run
    compare = deterministic and values
    total = batching.batch_size(flat)
    if total < 2:
        return deterministic
    k = micro_batch_count(total, chunks)
    with mode(model), torch.no_grad():
        micro, sizes = batching.split(flat, k)
        batching.checked_sizes = list(sizes)
        weights = batching.weights(flat, micro, "the sample")  # decided as for a call
    # the split compared at nudged weights alone where it agrees there: a mixing shows at either
    # weights, and behind a gate initialised at zero only there (a forward saved per build);
    # where it does not agree, or the nudged model fails, the checks at the build's weights say why
    runs = _nudged_runs(batching, gm, model, flat, micro, mode) if compare and nudge else None
    if runs is None or not _agrees_nudged(batching, runs, sizes):
        with state_kept(model, gm), mode(model), torch.no_grad():
            try:
                outs = [list(gm(*m)) for m in micro]
            except Exception as e:  # noqa: BLE001 - the split inputs are what broke it
                raise MicroBatchError(
                    f"the model fails on a micro-batch ({type(e).__name__}: {str(e).strip().splitlines()[0]}). "
                    f"The inputs are split along {batching.dims_text()}; if the batch is in another dim of an "
                    "input, say so with chunk_dims={'<argument>': dim} (None for an argument that must not "
                    "be split). If it is, the capture fixed the batch's size somewhere in the model's code "
                    "(len(x) under torch.export is a Python int, the sample's: write x.shape[0]).") from e
        for i, (a, column) in enumerate(zip(whole, zip(*outs))):  # in output order
            b = batching._merge_leaf(i, list(column), sizes, weights.get(i))
            if compare and provisional and not same_value(a, b):
                provisional = False
                deterministic = reruns_same(gm, model, flat, whole, mode)
                compare = deterministic and values
            if not same_value(a, b, values=compare):
                found = blame(micro) if blame is not None and compare else ""
                _refuse(batching, i, a, b, list(column), k, found, why, mode_text)
        differs = _nudged_difference(batching, runs, sizes) if compare and runs is not None else None
        if differs is not None:  # where training will move the weights: a mixing behind a gate initialised at 0
            i, a, b, column = differs
            _refuse(batching, i, a, b, column, k, "(at the build's weights it did not: a mixing behind a gate "
                    "initialised at zero, which the first optimizer step opens; found at weights nudged by "
                    f"{NUDGE:g} of each tensor's size)", why, mode_text)
    if compare and nudge:  # a merged loss: its gradient must be the batch's too
        confirm = (lambda: reruns_same(gm, model, flat, whole, mode)) if provisional else None
        deterministic = check_merged_gradients(batching, gm, model, flat, whole, micro, sizes, weights, mode, confirm)
    return deterministic


def check_merged_gradients(batching: Batching, gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any],
                           whole: Sequence[Any], micro: List[List[Any]], sizes: List[int], weights: Any,
                           mode: Callable[[nn.Module], Any], confirm: Optional[Callable[[], bool]]) -> bool:
    """Refuses a merged loss (a 0-dim output merged by mean or sum) whose gradient at nudged
    weights is not the whole sample's, and a per-sample output whose gradient differs where the
    model runs backward code fxpipe cannot read; its value may agree while its gradient does not.
    ``whole``: the sample's outputs, for their structure. ``confirm()``, where the graph's
    determinism rests on one run alone: whether a reseeded run gives the same, asked before
    refusing (a graph drawing from a generator of its own is not compared). Returns whether
    the graph is deterministic."""
    k = len(micro)
    reduced = [i for i, a in enumerate(whole) if isinstance(a, Tensor) and a.dim() == 0
               and a.is_floating_point() and batching.merges[i] is not None]
    unseen = unseen_backward(gm)  # backward code of the model's own: its gradients compared too
    per_sample = [i for i, a in enumerate(whole) if unseen and isinstance(a, Tensor) and a.dim() > 0
                  and a.is_floating_point() and (batching.merges[i] is None or isinstance(batching.merges[i], int))]
    if not (reduced or per_sample):
        return True
    with mode(model):
        torch.manual_seed(1)
        bad = gradient_mismatch(gm, flat, micro, reduced + per_sample,
                                lambda i, parts: batching._merge_leaf(i, parts, sizes, weights.get(i)))
    if bad is not None and confirm is not None and not confirm():
        return False  # random after all: values are not compared
    if bad is not None and bad[0] in per_sample:
        i, param, diff, scale = bad
        raise MicroBatchError(
            f"{_output_label(batching.out_names[i])} merged over {k} micro-batches is the full batch's, but its "
            f"gradient is not: the gradient of parameter '{param}' differs by up to {diff:.3g} (largest "
            f"|gradient| {scale:.3g}). The model runs backward code fxpipe cannot read -- {'; '.join(unseen[:3])} "
            "-- and one of them mixes the samples in backward only (a gradient normalised over the batch); a "
            "pipeline runs it per micro-batch, and training would silently differ from the model. What to do: "
            "make that backward act per sample, or chunks=1")
    if bad is not None:
        i, param, diff, scale = bad
        raise MicroBatchError(
            f"{_output_label(batching.out_names[i])} merged over {k} micro-batches is close to the full "
            f"batch's value but its gradient is not the full batch's at weights near the model's (as training will "
            f"move them): the gradient of parameter '{param}' differs by up to "
            f"{diff:.3g} (largest |gradient| {scale:.3g}). Training the pipeline would silently "
            f"differ from the model. {_LOSS_NOTE}")
    return True


def micro_batch_count(total: int, chunks: int) -> int:
    """The most micro-batches up to ``chunks`` into which a batch of ``total`` splits (as the
    pipeline splits) with two samples in each, at least two micro-batches: [3, 3, 1] of a
    sample of 7 in 3 checked a micro-batch of one (a trial's ``.squeeze()`` head refused)."""
    for k in range(min(chunks, total // 2), 2, -1):
        if min(split_sizes(total, k)) >= 2:
            return k
    return 2


#: the outputs at nudged weights: the whole sample's, each micro-batch's, and the merge's weights there
NudgedRuns = Tuple[List[Any], List[List[Any]], Any]


def _nudged_runs(batching: Batching, gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any],
                 micro: List[List[Any]], mode: Callable[[nn.Module], Any]) -> Optional[NudgedRuns]:
    """The whole sample's and each micro-batch's outputs at nudged weights, and the merge's
    weights counted there (class weights a loss reads from a buffer are nudged too: counted at
    the model's own, a class-weighted loss was refused, a trial); None where the model fails
    there (a parameter read as an index)."""
    try:
        with mode(model), torch.no_grad(), nudged(gm):
            weights = batching.weights(flat, micro, "the sample")
            with state_kept(model, gm):
                whole = list(gm(*flat))
            with state_kept(model, gm):  # the micro-batches in turn, from the same state
                return whole, [list(gm(*m)) for m in micro], weights
    except Exception:  # noqa: BLE001 - weights the model cannot run at
        return None


def _agrees_nudged(batching: Batching, runs: NudgedRuns, sizes: List[int]) -> bool:
    """Whether the micro-batches merged give the whole sample's every output at nudged weights,
    all finite (an overflow there compares nothing)."""
    whole = runs[0]
    if any(isinstance(a, Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()) for a in whole):
        return False
    try:
        return _nudged_difference(batching, runs, sizes) is None
    except MicroBatchError:  # an output that does not merge: said by the check at the build's weights
        return False


def _nudged_difference(batching: Batching, runs: NudgedRuns, sizes: List[int]) -> Optional[tuple]:
    """``(output index, whole, merged, parts)`` of the first finite output whose micro-batches
    merged differ from the whole sample's at nudged weights (:func:`_nudged_runs`), or None. A
    batch mixing behind a zero-initialised gate (``h + gamma * proj(h.mean(0))``, ReZero /
    LayerScale) is invisible at the build's weights and appears at the first optimizer step (a
    trial: 5.8e-2 off after 5 Adam steps)."""
    whole, outs, weights = runs
    for i, (a, column) in enumerate(zip(whole, zip(*outs))):
        b = batching._merge_leaf(i, list(column), sizes, weights.get(i))
        finite = not isinstance(a, Tensor) or not a.is_floating_point() or bool(torch.isfinite(a).all())
        if finite and not same_value(a, b):
            return i, a, b, list(column)
    return None


def reruns_same(gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any], whole: Sequence[Any],
                mode: Callable[[nn.Module], Any]) -> bool:
    """Whether ``gm`` gives ``whole`` again with another seed (no randomness left in ``mode``),
    run from the state the checks start each run from (:func:`state_kept`): a forward writing
    state (a max-norm renormalisation moves rows by 1e-7 at each call) would differ from itself
    otherwise, and be compared for structure only."""
    with state_kept(model, gm), mode(model), torch.no_grad():
        torch.manual_seed(1)
        again = list(gm(*flat))
    return all(exactly_same(a, b) for a, b in zip(whole, again))

def sample_run(run: Callable[[], Any], model: nn.Module,
               mode: Optional[Callable[[nn.Module], Any]] = None, grad: bool = False) -> Any:
    """``run()`` on the whole sample under ``mode(model)`` (default eval), no_grad (``grad``:
    grad mode on, for a model whose code reads it), seeded (see check)."""
    with (mode or evaluating)(model), torch.set_grad_enabled(grad):
        torch.manual_seed(SAMPLE_SEED)
        return run()


@contextmanager
def state_kept(model: nn.Module, gm: fx.GraphModule) -> Iterator[None]:
    """Runs the block, then puts back the weights the forward writes in place
    (:func:`~fxpipe.capture._prepare.written_kept`: a constraint, a max-norm renormalisation), so
    that every run of the checks starts from the same weights. Left written, they hid a mixing:
    an ``nn.Embedding(max_norm=)`` tied to the LM head renormalised the sample's rows in the whole
    run, the micro-batches found them renormalised and agreed, reruns differed by 1e-7 (rows
    renormalised again) and were compared for structure only; each later batch's first
    micro-batch read a head its rows had not been renormalised in yet (a trial: gradients 0.515
    off, magnitude 3.1, silently). Buffers are left to move: updated once per micro-batch is
    the pipeline's documented semantics (an average, running statistics)."""
    with written_kept(model, sorted({name for n in gm.graph.nodes for name in n.meta.get(MUTATES_STATE, ())})):
        yield


def eager_run(captured: Capture, model: nn.Module, args: tuple, kwargs: dict,
              mode: Callable[[nn.Module], Any]) -> Any:
    """The model itself on the whole sample (:func:`sample_run`), grad mode on where its code
    reads it (as it was captured), refusing a parameter's ``.data`` it assigns anew in traced
    code (:class:`~fxpipe.checks._data_swaps.DataSwaps`). Call inside ``preserved(model)``."""
    reads_grad = captured.context is not None and captured.context.built.grad
    swaps = DataSwaps(model, captured.leaves)
    try:
        return sample_run(lambda: model(*args, **kwargs), model, mode, grad=reads_grad)
    finally:
        swaps.refuse()


def _refuse(batching: Batching, i: int, whole: Any, merged: Any, parts: List[Any], k: int, found: str, why: str,
            mode_text: str) -> None:
    name = batching.out_names[i]
    if isinstance(whole, Tensor) and isinstance(merged, Tensor):
        if whole.shape != merged.shape:
            what = f"has shape {tuple(whole.shape)} for the whole batch but {tuple(merged.shape)} merged"
        else:
            diff = (whole.double() - merged.double()).abs().max().item()
            what = f"differs by up to {diff:.3g} (largest |value| {whole.double().abs().max().item():.3g})"
    else:
        what = f"is {_short(whole)} for the whole batch but {_short(merged)} merged"
    head = (f"{_output_label(name)} {what} when the sample is split into {k} micro-batches along "
            f"{batching.dims_text()} and the outputs are merged{mode_text}")
    found = f" {found}" if found else ""
    if why:
        raise MicroBatchError(f"{head}{why}{found}")
    dim = concatenated_dim(whole, parts)
    current = batching.merges[i] if batching.merges[i] is not None else 0
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



@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block; every submodule's own flag is put back after."""
    with modes_kept(model):
        model.eval()
        yield



def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
