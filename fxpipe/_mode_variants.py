"""One pipeline in every mode the model is switched to: a graph with modes baked in, captured again.

torch.export bakes each module's ``training`` flag into aten ops (``dropout``'s flag, BatchNorm's
statistics, ``scaled_dot_product_attention``'s ``dropout_p``), and a traced forward that reads
``self.training`` keeps its value as a constant (:func:`fxpipe.capture._prepare.mode_sensitivity`).
Training loops switch those flags after the build: validation in the middle of training
(``model.eval()``, ``pipe(val)``, ``model.train()``), BatchNorm frozen for fine-tuning, dropout
turned off. Rather than refuse the call, the pipeline captures the model again with the flags it
has now, checks that capture as the build checked its own (the graph against eager, micro-batches
against the whole batch, on the build's sample), and carries the plan's cut over to it
(:mod:`fxpipe.plan._carry_over`): the same stages on the same devices, nothing profiled again.
Each set of flags seen is kept (:data:`LIMIT` of them, the least recently used dropped); switching
back is a dict lookup.

A capture runs the whole model, which a model whose stages sit on several devices cannot do after
the build: there the set with the root's mode flipped (``model.eval()`` of a model built in
training mode, and the reverse) is captured at the build, while the model is still on one device,
and any other set is refused with :class:`~fxpipe.errors.ModelChangedError` naming the modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .build import BuildOptions, CarryError, recapture
from .capture._baked_dtypes import BakedDtypes
from .capture._mode_flags import Flags, flags_of, listed, mode_changes
from .capture._model_check import ModelCheck
from .capture._prepare import preserved
from .capture._tracing import Capture
from .checks._batching import Batching
from .emit._stages import Stages
from .errors import FxpipeError, ModelChangedError, ModeError
from .plan._value import Plan
from .runtime._skip_layout import SkipLayout

__all__ = ["Variant", "ModeVariants", "LIMIT"]

#: captures kept per pipeline (each shares the model's parameters: a graph and its stage code)
LIMIT = 4


@dataclass
class Variant:
    """What a pipeline runs for one set of training flags: the capture, how it batches, the
    plan's cut on that graph, the stages, and the checks of what the stages hold."""

    capture: Capture
    batching: Batching
    plan: Plan
    stages: Stages
    model_check: ModelCheck
    dtypes: BakedDtypes
    #: step()'s loss_fn readings for this capture (fxpipe.checks._loss_fn), the latest last
    loss_readings: Dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, capture: Capture, batching: Batching, plan: Plan, stages: Stages) -> "Variant":
        return cls(capture, batching, plan, stages, ModelCheck(model, capture.graph_module, capture.reads, stages),
                   BakedDtypes(model, capture.graph_module, capture.method))

    @property
    def skip_layout(self) -> SkipLayout:
        return SkipLayout.from_names(len(self.stages), {p.name: (p.src, p.dst) for p in self.plan.portals})


class ModeVariants:
    """The variants of one pipeline, keyed by every module's ``training`` flag.

    ``baked`` says why the graph holds the modes ('' when it follows them: one variant, no
    key computed). ``sample`` is the build's (``args``, ``kwargs``), kept for later captures: a
    copy of one batch, None where the model cannot be run whole any more (stages on several
    devices); ``prepared`` then holds what the build captured for the flipped root mode,
    ``(flags, Checked or the error, Plan or None)``. ``emit`` makes the stages of a capture and a
    plan, placed and compiled as the pipeline's are.
    """

    def __init__(self, model: nn.Module, first: Variant, baked: str, *, sample: Optional[Tuple[Tuple[Any, ...], dict]],
                 options: BuildOptions, emit: Callable[[Capture, Plan], Stages],
                 prepared: Optional[Tuple[Flags, Any, Optional[Plan]]] = None) -> None:
        self.baked = baked
        self._named = list(model.named_modules())  # the modules as built, in model.modules() order
        self._modules = [m for _, m in self._named]
        self._model = model
        self._built = flags_of(self._modules)
        self._first = first
        self._variants: Dict[Flags, Variant] = {self._built: first}
        self._current = first
        self._current_flags = self._built
        self._sample = sample if baked else None
        self._options = options
        self._several_devices = prepared is not None  # the flipped root mode captured at the build
        self._emit = emit
        self._failed: Dict[Flags, BaseException] = {}
        if prepared is not None:
            flags, checked, plan = prepared
            if isinstance(checked, BaseException):
                self._failed[flags] = checked
            else:
                self._variants[flags] = Variant.of(model, checked.capture, checked.batching, plan,
                                                   emit(checked.capture, plan))

    @property
    def first(self) -> Variant:
        """The variant of the build (the plan was made for its capture)."""
        return self._first

    def current(self) -> Variant:
        """The variant for the flags the model has now, captured on first need."""
        if not self.baked:
            return self._current
        flags = flags_of(self._modules)
        if flags == self._current_flags:
            return self._current
        variant = self._variants.pop(flags, None)
        if variant is None:
            variant = self._capture(flags)
        self._variants[flags] = variant  # the latest last
        while len(self._variants) > LIMIT:  # captured again on need (a model on one device only)
            del self._variants[next(iter(self._variants))]
        self._current, self._current_flags = variant, flags
        return variant

    def _capture(self, flags: Flags) -> Variant:
        if flags in self._failed:
            raise self._refusal(flags, self._failed[flags])
        if self._sample is None:
            raise self._refusal(flags, None)
        args, kwargs = self._sample
        try:  # outside inference mode, as a build runs, leaving the model as it was
            with torch.inference_mode(False), preserved(self._model):
                checked, plan = recapture(self._model, args, kwargs, self._options, self.first.plan, self.first.capture)
        except (FxpipeError, CarryError) as e:
            self._failed[flags] = e
            raise self._refusal(flags, e) from e
        return Variant.of(self._model, checked.capture, checked.batching, plan, self._emit(checked.capture, plan))

    def _refusal(self, flags: Flags, cause: Optional[BaseException]) -> FxpipeError:
        changed = mode_changes(self._named, self._built)
        if cause is not None:
            why = f"capturing the model again in these modes failed: {type(cause).__name__}: {cause}"
        elif self._several_devices:
            why = ("its stages are on several devices, so the model cannot be run whole to capture it again in these "
                   "modes (only the root's mode flipped, model.train() / model.eval(), is captured at the build)")
        else:
            why = "it was made without a sample to capture the model again (use fxpipe.pipeline)"

        message = (f"this pipeline's graph has each module's mode baked in ({self.baked}), and {why}. Switch the "
                   "modes before the build, or build a pipeline in these modes (fxpipe.pipeline(model, ...); it shares "
                   "the model's parameters). What changed:\n" + listed(changed))
        if flags[0] != self._built[0]:  # the root's own mode: model.eval() / model.train()
            return ModeError(message)
        return ModelChangedError(message, changes=changed)
