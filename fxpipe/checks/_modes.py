"""The build-time checks in every mode the pipeline can run in: eval and training.

A pipeline computes each micro-batch on its own. The micro-batch check
(:func:`fxpipe.checks._micro_batches.check_split`) sees whether that reproduces the whole batch, but
only in the mode it runs in, and modules may mix the samples of a batch in training only:
``h - h.mean(0)`` under ``if self.training``, in-batch negatives, a custom norm. Such a module
kept opaque (``leaf_modules``, or because fx cannot trace it) passes an eval-mode check and
trains a silently different model. So the check runs in both modes the captured graph can
run in (a graph with the mode baked in runs only in its own), with two exceptions that are
not batch mixing:

* ``nn.Dropout`` modules and BatchNorm are put in eval mode for the training-mode check:
  dropout is per element (and random, which would hide every other difference), and
  BatchNorm on micro-batch statistics is GPipe's documented semantics
  (``deferred_batch_norm=True`` for the running statistics). Under torch.export both are
  baked into the graph and cannot be switched: a training-mode export graph with a
  BatchNorm in training is checked for structure only.
* Randomness the mode does not switch off (functional dropout, noise, stochastic depth):
  the check notices that another seed gives another result and compares structure only.

A failure in training mode refuses the build when the model is in training mode; a model
built in eval mode gets a pipeline that is exact in eval and refuses training mode at call
time with the same message. A refusal names the first module whose output differs while
its inputs agree (per-module outputs of the whole and the split run compared by forward hooks).
"""

from __future__ import annotations

import contextlib
import io
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.utils import _pytree as pytree

from ..capture._values import same_value
from ._batching import Batching, ChunkDims, OutputMerge, input_split_dims
from ._randomness_off import randomness_off
from ._varied_sample import ATTEMPTS, alike, alike_inputs, padded, varied
from ._micro_batches import (SAMPLE_SEED, check_merged_gradients, check_split, eager_run, evaluating, reruns_same,
                             sample_run)
from ._one_pass import one_pass
from ._stressed import check_stressed
from ..errors import FxpipeError, MicroBatchError, TraceError
from ..capture._meta import is_meta_model
from ..capture._mode_flags import modes_kept
from ..capture._numerics import checking
from ..capture._prepare import Prepared, check_capture, preserved
from ..runtime._randomness import drew_random

__all__ = ["check_modes", "training"]

Mode = Callable[[nn.Module], Any]

_TRAIN_WHY = (
    ", though they agree in eval mode: something computes across the samples of the batch "
    "only in training (a batch statistic, in-batch negatives, a custom norm). The check runs the training mode "
    "with nn.Dropout and BatchNorm modules in eval mode (dropout is per sample; BatchNorm on micro-batch "
    "statistics is GPipe's documented semantics), so neither is the cause. A pipeline computes each "
    "micro-batch on its own and would silently train a different model.")
_TRAIN_TODO = (
    " What to do: compute the across-batch part outside the pipeline, on its merged outputs, or make it per "
    "sample; for batch normalisation use nn.BatchNorm (deferred_batch_norm=True for whole-batch running "
    "statistics); for inference only, build the pipeline in eval mode (model.eval()).")


@contextmanager
def training(model: nn.Module, exempt: bool = True) -> Iterator[None]:
    """Training mode for the block: the flags as they are when the model is training (the mode
    it was built in), else ``model.train()`` (what ``pipe.train()`` gives). With ``exempt``,
    dropout and BatchNorm modules in eval mode (see the module docstring). Flags put back after."""
    with modes_kept(model):
        if not model.training:
            model.train()
        if exempt:
            for m in model.modules():
                if isinstance(m, (_BatchNorm, _DropoutNd)):
                    m.training = False
        yield


def check_modes(model: nn.Module, prepared: Prepared, args: tuple, kwargs: dict, chunk_dims: ChunkDims,
                output_merge: Optional[OutputMerge], chunks: int = 2,
                record: Optional[Callable[..., Any]] = None) -> Batching:
    """The split/merge checked in each mode the graph runs in, and the graph against eager
    in the mode(s) it is compared in. Call inside ``preserved(model)``. The checks run at
    full float32 precision, with tolerances that follow what stays reduced (bf16 weights,
    autocast): :mod:`fxpipe.capture._numerics`. ``record``: called as the graph on the first
    micro-batch of the one-pass check (:func:`~fxpipe.checks._one_pass.one_pass`)."""
    flat = prepared.capture.flatten_inputs(args, kwargs)
    names, dims = input_split_dims(model, args, kwargs, chunk_dims)
    _refuse_fixed_batch(prepared, flat, names, dims)
    if alike(flat, dims):  # a sample of identical rows hides batch mixing: checked on varied ones
        for attempt in range(ATTEMPTS):
            other = varied(flat, dims, attempt)
            failure = "its inputs hold one value throughout" if other is None else _fails_on(prepared, model, other)
            if not failure or other is None:
                break
        if not failure:
            flat = other  # type: ignore[assignment]
            args, kwargs = pytree.tree_unflatten(flat, prepared.capture.in_spec)
        elif chunks > 1:
            raise MicroBatchError(
                "every sample of the sample is the same (a dummy input: torch.zeros, torch.ones, one example "
                "repeated), and such a batch cannot show whether the model mixes its samples: h - h.mean(0) gives "
                "each micro-batch the whole batch's result there. fxpipe checks such a sample with its samples made to "
                f"differ, but {failure}. What to do: build from a sample of real data (two or more samples that "
                "differ), or with chunks=1")
    else:
        found = _rows_varied(prepared, model, flat, dims) if chunks > 1 else None
        if found is not None:  # a mask or an input alike in every row hides a mixing through it: checked varied
            flat_varied, masks, inputs = found
            args_varied, kwargs_varied = pytree.tree_unflatten(flat_varied, prepared.capture.in_spec)
            try:
                with checking(model, flat_varied):
                    return _check_modes(model, prepared, args_varied, kwargs_varied, flat_varied, chunk_dims,
                                        output_merge, chunks, record)
            except FxpipeError as e:  # what the varied copy shows, a batch at a call would meet
                own = _refused_as_given(model, prepared, args, kwargs, flat, chunk_dims, output_merge, chunks)
                if own is not None:
                    raise own from None  # the sample as given is refused too: its own refusal, no note on the copy
                if not isinstance(e, MicroBatchError):
                    e.add_note(f"(found on a copy of the sample with {_varied_said(names, masks, inputs)})")
                    raise
                raise MicroBatchError(f"{e} ({_why_varied(names, masks, inputs)})") from e
            except Exception:  # noqa: BLE001 - the model does not take such values: checked as given
                pass
    with checking(model, flat):
        return _check_modes(model, prepared, args, kwargs, flat, chunk_dims, output_merge, chunks, record)


def _refused_as_given(model: nn.Module, prepared: Prepared, args: tuple, kwargs: dict, flat: List[Any],
                      chunk_dims: ChunkDims, output_merge: Optional[OutputMerge], chunks: int
                      ) -> Optional[FxpipeError]:
    """The checks' refusal of the sample as given, where its varied copy was refused, or None:
    such a refusal is not about the rows alike (an output_merge to declare), and is raised as it
    is, with no note on the copy (a review: a GPT-2 sample with position_ids was told they mix
    the samples)."""
    try:
        with checking(model, flat):
            _check_modes(model, prepared, args, kwargs, flat, chunk_dims, output_merge, chunks, None)
    except FxpipeError as e:
        return e
    except Exception:  # noqa: BLE001 - the copy's refusal stands
        return None
    return None


def _rows_varied(prepared: Prepared, model: nn.Module, flat: List[Any], dims: List[Optional[int]]
                 ) -> Optional[Tuple[List[Any], List[int], List[int]]]:
    """A copy of the sample for the checks, with every mask alike in every row padded as a
    collator pads, and every other input alike in every row varied per sample where the model
    runs on the copy (:mod:`fxpipe.checks._varied_sample`): (the copy, the masks padded, the
    inputs varied); None where the sample has neither."""
    found = padded(flat, dims)
    out, masks = found if found is not None else (list(flat), [])
    inputs = [i for i in alike_inputs(out, dims) if i not in masks]
    for attempt in range(ATTEMPTS if inputs else 0):
        other = varied(out, dims, attempt, only=inputs)
        if other is not None and not _fails_on(prepared, model, other):
            return other, masks, [i for i in inputs if other[i] is not out[i]]
    return (out, masks, []) if masks else None


def _varied_said(names: List[str], masks: List[int], inputs: List[int]) -> str:
    said = [f"{', '.join(names[i] for i in masks)} padded, as a collator pads"] if masks else []
    said += [f"{', '.join(names[i] for i in inputs)} varied per sample"] if inputs else []
    return " and ".join(said) + ": the sample's held the same in every row"


def _why_varied(names: List[str], masks: List[int], inputs: List[int]) -> str:
    why = [f"Checked with {_varied_said(names, masks, inputs)}, which hides a mixing through it."]
    if masks:
        why.append(
            "A mixing through a mask shows only where rows differ in length; the check was given rows with trailing "
            "zeros, a different length per row, as a collator pads a batch. A model that trims or sizes each batch by "
            "its mask, h[:, :mask.sum(1).max()], gives a sample a result that depends on the batch it came in: trim "
            "in the collator instead.")
    if inputs:
        why.append(
            f"{', '.join(names[i] for i in inputs)} was given a different value per sample: the model combines the "
            "samples through it (weights normalised over the batch, a value divided by the batch's largest, counts of "
            "the batch's labels), and real batches would train silently otherwise than the model. Make that per "
            "sample, or compute it outside the pipeline; a value that is one for the whole batch, pass as a Python "
            "number or a 0-dim tensor (given whole to every micro-batch).")
    return " ".join(why) + " Or build with chunks=1."


def _fails_on(prepared: Prepared, model: nn.Module, flat: List[Any]) -> str:
    """'' where the graph runs on ``flat`` (the varied sample) to finite floating outputs, else
    what went wrong, said."""
    gm = prepared.capture.graph_module
    try:  # torch.fx prints a failing graph's traceback to stderr before raising: not the user's to read
        with preserved(model), contextlib.redirect_stderr(io.StringIO()):
            outs = list(sample_run(lambda: gm(*flat), model))
    except Exception as e:  # noqa: BLE001 - a value the model rejects (a BCE target out of [0, 1])
        return f"the model fails on the varied copy ({type(e).__name__}: {str(e).strip().splitlines()[0][:160]})"
    if any(isinstance(o, Tensor) and o.is_floating_point() and not bool(torch.isfinite(o).all()) for o in outs):
        return "the model's outputs on the varied copy are not finite (a log or a division at its own inputs' edge)"
    return ""


def _refuse_fixed_batch(prepared: Prepared, flat: List[Any], names: List[str], dims: List[Optional[int]]) -> None:
    """torch.export fixed the batch's size (the model's code depends on it: a Python loop over
    the samples, ``for i in range(x.shape[0])``, unrolled at the sample's size): every
    micro-batch would fail or be computed as a batch of the sample's size. Said so, rather
    than as a micro-batch failure with advice about ``chunk_dims`` (a trial)."""
    for i, (x, d) in enumerate(zip(flat, dims)):
        fixed = prepared.capture.fixed.get(i)
        if fixed is None or d is None or not isinstance(x, Tensor) or d >= len(fixed) or fixed[d] is None:
            continue
        if fixed[d] > 1:
            raise MicroBatchError(_FIXED_BATCH.format(what=f"fixed the batch's size at {fixed[d]} (dim {d} of {names[i]})"))
    guards = prepared.capture.guards
    least = max((guards.ranges[s][0] for s in guards.batch if s in guards.ranges and guards.ranges[s][0]), default=0)
    if least > 2:  # torch.export keeps a size of 2 or more symbolic; more is the code's own demand
        raise MicroBatchError(_FIXED_BATCH.format(what=f"holds only for batches of at least {least} samples"))


_FIXED_BATCH = (
    "torch.export's capture {what}: the model's code depends on the batch's size -- a Python loop over the samples "
    "(for i in range(x.shape[0])) unrolled at the sample's size, a reshape naming it -- so a micro-batch of another "
    "size cannot run. What to do: move that code into a submodule, which fxpipe keeps opaque where torch.fx cannot "
    "trace it, or write it with tensor ops over the batch")


def _check_modes(model: nn.Module, prepared: Prepared, args: tuple, kwargs: dict, flat: List[Any],
                 chunk_dims: ChunkDims, output_merge: Optional[OutputMerge], chunks: int,
                 record: Optional[Callable[..., Any]]) -> Batching:
    captured = prepared.capture
    gm = captured.graph_module
    meta = is_meta_model(model)
    fx_graph = captured.method != "export"
    train_mode: Mode = lambda m: training(m, exempt=fx_graph)  # noqa: E731
    runs_eval = not prepared.mode_sensitive or not model.training
    runs_train = not prepared.mode_sensitive or model.training
    batching: Optional[Batching] = None
    pre_hooked = [name for name in captured.leaves if not fx_graph and model.get_submodule(name)._forward_pre_hooks]

    def blame_in(mode: Mode, always: bool) -> Callable[[List[List[Any]]], str]:
        return lambda micro: "" if meta else first_difference(gm, model, flat, micro, mode, always)

    def run_checks(mode: Mode, **options: Any) -> Tuple[Batching, List[Any], bool, Quiet, bool]:
        """(batching, the graph's whole outputs, deterministic, the quiet it ran under, whether
        the graph was compared with the eager model already: :mod:`fxpipe.checks._one_pass`)."""
        if batching is None and not meta and options.get("values", True) and options.get("nudge", True):
            # the first mode checked is the one compared with eager: all of it in one pass where it agrees
            done = one_pass(captured, model, args, kwargs, flat, mode, chunks,
                            lambda leaves: Batching.build(model, args, kwargs, captured.unflatten_output(leaves),
                                                          chunk_dims, output_merge), record)
            if done is not None:
                quiet: Quiet = randomness_off if done.quieted else nullcontext
                with preserved(model), quiet():
                    deterministic = check_merged_gradients(
                        done.batching, gm, model, flat, done.whole, done.micro, done.sizes, done.weights, mode,
                        confirm=lambda: reruns_same(gm, model, flat, list(sample_run(lambda: gm(*flat), model, mode)),
                                                    mode))
                return done.batching, done.whole, deterministic, quiet, True
        # dropout and elementwise draws (F.dropout(h, p, self.training), attention's dropout_p, DropPath,
        # noise) made constant: compared values and all where nothing else draws (fxpipe.checks._randomness_off)
        with preserved(model), randomness_off() as off:
            whole = list(sample_run(lambda: gm(*flat), model, mode))
            random = drew_random(SAMPLE_SEED)  # none: no second, reseeded run (fxpipe.runtime._randomness)
        quiet: Quiet = randomness_off if off.replaced else nullcontext  # nothing to switch off: nothing to pay
        if random:  # draws it cannot make constant (randperm, randint): the model's own run, structure compared
            with preserved(model):
                whole = list(sample_run(lambda: gm(*flat), model, mode))
            quiet = nullcontext
        b = batching or Batching.build(model, args, kwargs, captured.unflatten_output(whole), chunk_dims, output_merge)
        with preserved(model), quiet():
            deterministic = check_split(b, gm, model, flat, whole, mode=mode, random=random, chunks=chunks,
                                        **options)
        return b, whole, deterministic, quiet, False

    def against_eager(mode: Mode, whole: List[Any], deterministic: bool, quiet: Quiet) -> None:
        if not meta:  # on meta, eager code may branch on values (.item()), and none are there
            with preserved(model), quiet():
                eager = eager_run(captured, model, args, kwargs, mode)
            try:
                check_capture(eager, whole, batching.out_names, deterministic,  # type: ignore[union-attr]
                              pre_hooked)
            except TraceError:
                # deterministic may rest on fxpipe.runtime._randomness alone: confirm before refusing
                with preserved(model), quiet():
                    if not deterministic or reruns_same(gm, model, flat, whole, mode):
                        raise
                check_capture(eager, whole, batching.out_names, False, pre_hooked)  # type: ignore[union-attr]

    def stressed(mode: Mode, deterministic: bool) -> None:
        if deterministic and not meta and captured.leaves:  # opaque code deciding from the values: one more check
            with preserved(model):
                check_stressed(batching, gm, model, flat, captured.leaves, mode, chunks,  # type: ignore[arg-type]
                               lambda f, micro: first_difference(gm, model, f, micro, mode, always=False))

    if runs_eval:
        batching, whole, deterministic, quiet, compared = run_checks(evaluating,
                                                                     blame=blame_in(evaluating, always=False))
        if not compared:
            against_eager(evaluating, whole, deterministic, quiet)
        stressed(evaluating, deterministic)
    if runs_train:
        # Under export, BatchNorm's training is baked in and cannot be exempted: structure only.
        values = fx_graph or not any(isinstance(m, _BatchNorm) and m.training for m in model.modules())
        why = _TRAIN_WHY if runs_eval else ""  # without an eval check: the generic advice
        try:
            batching, whole, deterministic, quiet, compared = run_checks(
                train_mode, values=values, blame=blame_in(train_mode, always=True), why=why,
                mode_text=" in training mode", nudge=not runs_eval)  # nudged once: in the first mode checked
        except MicroBatchError as e:
            if not why:
                raise
            if model.training or batching is None:
                raise MicroBatchError(f"{e}{_TRAIN_TODO}") from None
            batching.train_refusal = (
                f"this pipeline was built in eval mode, where it is exact, and cannot run in training mode: "
                f"the build's training-mode check found that {e}{_TRAIN_TODO}")
        else:
            if prepared.mode_sensitive and not compared:  # the graph has training baked in: compared in training
                against_eager(train_mode, whole, deterministic, quiet)
            if not runs_eval and values:
                stressed(train_mode, deterministic)
    assert batching is not None
    return batching


Call = Tuple[str, List[Tensor], List[Tensor]]
#: what a check runs under: nothing, or randomness made constant (fxpipe.checks._randomness_off)
Quiet = Callable[[], AbstractContextManager]


def _calls(model: nn.Module, run: Callable[[], Any]) -> List[Call]:
    """Per completed submodule call, in completion order (innermost first): its qualified
    name, its positional input tensors and its output tensors."""
    names = {m: n for n, m in model.named_modules() if n}
    calls: List[Call] = []

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        calls.append((names[module], _tensors(inputs), _tensors(output)))

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _tensors(value: Any) -> List[Tensor]:
    return [x.detach() for x in pytree.tree_leaves(value) if isinstance(x, Tensor)]


def _agree(whole: List[Tensor], parts: List[List[Tensor]]) -> Optional[bool]:
    """Whether the parts, concatenated along the one dim that fits, equal whole; None when no
    tensor can be compared (same count, shapes that concatenate to the whole's)."""
    seen = False
    for j, w in enumerate(whole):
        column = [p[j] for p in parts if j < len(p)]
        if len(column) != len(parts):
            continue
        for d in range(w.dim()):
            if all(c.dim() == w.dim() and c.shape[:d] == w.shape[:d] and c.shape[d + 1:] == w.shape[d + 1:]
                   for c in column) and sum(c.shape[d] for c in column) == w.shape[d]:
                seen = True
                if not same_value(w, torch.cat(column, dim=d)):
                    return False
                break
    return True if seen else None


def first_difference(gm: Any, model: nn.Module, flat: Sequence[Any], micro: List[List[Any]], mode: Mode,
                     always: bool) -> str:
    """A sentence naming the first module (in completion order) whose output differs between the
    whole and the split run: one whose inputs agree mixes the samples itself. With ``always``
    also a module whose inputs already differ (the mixing happened in traced code before it)."""
    def run(inputs: Sequence[Any]) -> List[Call]:
        with preserved(model), mode(model), torch.no_grad():
            torch.manual_seed(0)
            return _calls(model, lambda: gm(*inputs))

    whole = run(flat)
    split: List[Dict[Tuple[str, int], Call]] = []
    for inputs in micro:
        seen: Dict[str, int] = {}
        indexed = {}
        for call in run(inputs):
            indexed[(call[0], seen.get(call[0], 0))] = call
            seen[call[0]] = seen.get(call[0], 0) + 1
        split.append(indexed)
    count: Dict[str, int] = {}
    modules = dict(model.named_modules())
    for name, ins, outs in whole:
        key = (name, count.get(name, 0))
        count[name] = key[1] + 1
        if not all(key in s for s in split):
            continue
        if _agree(outs, [s[key][2] for s in split]) is not False:
            continue
        kind = type(modules[name]).__name__
        if _agree(ins, [s[key][1] for s in split]):
            return (f"The first module whose output differs while its inputs agree is '{name}' ({kind}): it "
                    "computes across the samples of the batch.")
        if always:
            return (f"The values already differ where they enter module '{name}' ({kind}): the across-batch "
                    "computation is in the traced code before it.")
        return ""
    return ""
