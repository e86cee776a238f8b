"""``fxpipe.pipeline``: trace any ``nn.Module``, balance it, portal its long edges, run it.

The data path (docs/how-it-works.md): capture -> profile -> OpGraph -> partition -> Plan
-> emit -> runtime. Each step is a plain value kept on the returned :class:`Pipeline`
(``capture``, ``plan``, ``stages``) so it can be printed, saved and tested on its own.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn

from ._step import ReturnOutputs, run_step, refuse_forward_with_grad
from ._mode_variants import ModeVariants, Variant
from .build import BuildOptions, build, check_split_points, emit_and_place
from .capture._meta import refuse_running
from .capture._tracing import Capture
from .checks._batching import Batching, ChunkDims, OutputMerge
from .checks._loss_fn import LossFnReading, out_dims_of
from .checks._loss_keys import loss_key
from .emit._compiling import (CompileOption, check_compile_option, check_graph_replay, compile_stages,
                              refuse_whole_pipeline_compile)
from .emit._stages import Stages
from .errors import ArgumentError, DevicesError, InputMismatchError, PipelinePicklingError, StagesError, SubmoduleAccessError
from .plan._make import BALANCE_BY
from .plan._value import Plan
from .progress import Progress, ProgressOption, as_progress
from .runtime._batchnorm import commit_deferred_batch_norm, deferring, refuse_deferred_in_graph
from .runtime._devices import Device, default_devices
from .runtime._frontend import PlacedModule, check_checkpoint, check_chunks, checkpoint_stop
from .runtime._microbatch import Batch
from .runtime._orders import check_schedule
from .runtime._pipeline import PipelineRunner

__all__ = ["pipeline", "Pipeline"]



def _check_args(model: nn.Module, n_stages: int, chunks: int, checkpoint: str, balance_by: str,
                split_points: Optional[Sequence[str]] = None, plan: Any = None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise StagesError(f"n_stages must be a positive integer (the number of pipeline stages), got "
                          f"n_stages={n_stages!r}; pass n_stages=1 or more", argument="n_stages")
    check_chunks(chunks)
    check_checkpoint(checkpoint)
    if balance_by not in BALANCE_BY:
        raise ArgumentError(f"balance_by must be one of {', '.join(map(repr, BALANCE_BY))}, got "
                            f"balance_by={balance_by!r}; pass one of them (the default is 'time')",
                            argument="balance_by")
    check_split_points(split_points, plan)


def _devices(devices: Optional[Iterable[Device]], n_stages: int) -> List[torch.device]:
    device_list = default_devices(n_stages) if devices is None else [torch.device(d) for d in devices]
    if len(device_list) < n_stages:
        found = "found" if devices is None else "given"
        raise DevicesError(
            f"too few devices for the stages (devices: {len(device_list)} {found}, n_stages: {n_stages}); "
            f"pass devices= with one device per stage (a device may repeat: ['cuda:0', 'cuda:0', 'cuda:1']), "
            f"or use n_stages={len(device_list)} or fewer")
    return device_list[:n_stages]


class Pipeline(PlacedModule):
    """A model run as a GPipe pipeline of generated stages.

    Call it like the model: ``pipe(*args, **kwargs)`` returns the model's output structure.
    The stages share the model's own parameters and buffers, so training the pipeline trains
    the model; ``state_dict()`` has the model's keys. Moving it whole (``.cuda()``,
    ``.to(device)``) is refused: its stages are placed on their devices.

    Attributes:
        module: the model.
        stages: the emitted :class:`~fxpipe.emit._stages.Stages`: ``stages[k]`` is stage ``k``'s
            ``torch.fx.GraphModule`` (readable ``.code``); ``print(stages)`` shows them all
            with their inputs, outputs, stashes and pops.
        plan: the :class:`~fxpipe.plan._value.Plan` (print it; ``plan.save(path)`` to reuse it).
        devices, chunks, checkpoint, schedule: as given.
        meta: built from a model on the meta device: planned and emitted, but calling it
            raises :class:`~fxpipe.errors.MetaDeviceError` (there are no values to run on).
    """

    def __init__(
        self, model: nn.Module, captured: Capture, plan: Plan, stages: Stages,
        devices: List[torch.device], chunks: int, checkpoint: str, deferred_batch_norm: bool,
        mode_sensitive: str = "", batching: Optional[Batching] = None, meta: bool = False,
        schedule: str = "gpipe", *, sample: Optional[Tuple[Tuple[Any, ...], dict]] = None,
        options: Optional[BuildOptions] = None, compile_options: Optional[Dict[str, Any]] = None,
        prepared: Optional[Tuple[Any, Any, Any]] = None,
    ) -> None:
        super().__init__()
        self.module = model
        self.meta = meta
        self.plan = plan
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        #: why the graph holds each module's training mode ('' when it follows them)
        self.mode_sensitive = mode_sensitive
        self.training = model.training  # the pipeline starts in the model's mode
        self._compile_options = compile_options
        first = Variant.of(model, captured, batching if batching is not None else _default_batching(model, captured),
                           plan, stages)
        # Each set of modes the model is switched to runs its own capture, cut as planned
        # (fxpipe._mode_variants); a graph that follows the modes has one.
        self._variants = ModeVariants(
            model, first, mode_sensitive, sample=sample,
            options=options or BuildOptions(len(stages), chunks, devices), emit=self._emit, prepared=prepared)
        self._active = first
        runtime = PipelineRunner(list(stages.modules), devices, skip_layout=first.skip_layout, stage_portals=True,
                                 spread=True)
        if deferred_batch_norm:
            refuse_deferred_in_graph(captured.graph_module, captured.method, chunks)
        self._open(runtime, model, deferred_batch_norm)  # close() undoes the conversion

    # The active capture's values (fxpipe._mode_variants: one per set of modes the model ran in).
    @property
    def capture(self) -> Capture:
        """The capture the pipeline runs now (the build's, or one in the modes the model has now)."""
        return self._active.capture

    @property
    def batching(self) -> Batching:
        """How inputs are split into micro-batches and outputs merged (checked on the sample)."""
        return self._active.batching

    @property
    def stages(self) -> Stages:
        """The stages the pipeline runs now: ``stages[k]`` is stage ``k``'s ``GraphModule``."""
        return self._active.stages

    def _emit(self, captured: Capture, plan: Plan) -> Stages:
        """Stages for another capture of the model, placed (and compiled) as the build's."""
        stages = emit_and_place(self.module, captured, plan, self.devices, Progress(enabled=False))
        if self._compile_options is not None:
            compile_stages(stages, self._compile_options)
        return stages

    def _follow_modes(self) -> None:
        """Runs the capture made for the modes the model has now (captured on first need)."""
        variant = self._variants.current()
        if variant is not self._active:
            self._runtime.set_partitions(list(variant.stages.modules), variant.skip_layout)
            self._active = variant

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stage_code(self, k: int) -> str:
        """Readable code of stage ``k``, with the original source lines as comments."""
        return self.stages.stage_code(k)

    # The model's keys, not prefixed by "module.".
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the parameters the stages hold; use assign=False")
        return self.module.load_state_dict(state_dict, strict=strict)

    # The model's names as well (optimizer parameter groups are built by name); parameters()
    # and buffers() follow, in the model's order.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:  # type: ignore[override]
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:  # type: ignore[override]
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    @property
    def checkpoint(self) -> str:
        """``'always'``, ``'except_last'`` or ``'never'``; may be set between calls."""
        return self.__dict__["_checkpoint_mode"]

    @checkpoint.setter
    def checkpoint(self, mode: str) -> None:  # checked: a wrong one was a bare KeyError at the next call
        self.__dict__["_checkpoint_mode"] = check_checkpoint(mode)

    @property
    def schedule(self) -> str:
        """The order of a training step: ``'gpipe'`` or ``'1f1b'`` (:mod:`fxpipe.runtime._orders`);
        may be set between calls."""
        return self.__dict__["_schedule"]

    @schedule.setter
    def schedule(self, schedule: str) -> None:  # checked: 'zbv' was taken, and ran as something else
        self.__dict__["_schedule"] = check_schedule(schedule)

    def __getattr__(self, name: str) -> Any:
        # The names above are the model's: torch.func.functional_call(pipe, {"0.weight": w}, x) looks
        # their modules up here to swap tensors in for one call, which the stages (built on the model's
        # own tensors, checked at each call) cannot follow. Said plainly, as the cause of torch's error.
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules or name not in modules["module"]._modules:
                raise
        raise SubmoduleAccessError(
            f"'{name}' is a submodule of the model, not of the pipeline: fxpipe.Pipeline names the model's parameters "
            "and buffers as the model does (for optimizers and state dicts), but its stages run the model's own "
            "tensors, so they cannot be swapped for one call (torch.func.functional_call, torch.nn.utils.stateless). "
            "What to do: call functional_call on the model (pipe.module), or copy the values into the model's "
            "parameters (with torch.no_grad(): p.copy_(v)) and call the pipeline")

    def _apply(self, fn: Any, recurse: bool = True) -> "Pipeline":  # type: ignore[override]
        # pipe.to(dtype): nn.Module converts parameters in place (.data) but gives buffers new
        # tensors, and the stages hold the buffers they were built with (fxpipe.capture._model_check):
        # the converted values go into those same objects.
        held = [(m._buffers, k, b) for m in self.module.modules() for k, b in m._buffers.items() if b is not None]
        super()._apply(fn, recurse)
        for buffers, key, old in held:
            new = buffers.get(key)
            if new is not None and new is not old:
                old.data = new
                buffers[key] = old
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        # fx unpickles a GraphModule by re-tracing its code, which would run the stages'
        # portal calls (stash/pop) instead of recording them: refused rather than inexact.
        raise PipelinePicklingError(
            "an fxpipe.Pipeline cannot be pickled (torch.save/pickle): fx rebuilds generated stage "
            "code by re-tracing it, which would not reproduce the portals between stages. Save the "
            "model and the plan instead -- torch.save(pipe.state_dict(), path) and "
            "pipe.plan.save('plan.json') -- and rebuild with fxpipe.pipeline(model, sample, n_stages, "
            "plan='plan.json') (no profiling). copy.deepcopy(pipe) works."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        flat, micro, sizes, weights, batches = self._micro_batches(args, kwargs)
        refuse_forward_with_grad(self.schedule, self.training)  # 1F1B's backward is step()'s
        stop = checkpoint_stop(self.checkpoint, len(batches), self.training)
        with deferring(self._deferred), self.batching.naming_sizes(sizes):
            self._runtime.run(batches, stop)
        if self.training:  # as eager BatchNorm: training mode updates statistics, grad or not
            commit_deferred_batch_norm(self._deferred, len(batches), self.module)
        merged = self.batching.merge([b.values for b in batches], sizes, weights)
        return self.capture.unflatten_output(merged)

    def step(self, *args: Any, loss_fn: Optional[Callable[..., torch.Tensor]] = None, target: Any = None,
             loss_reduction: Optional[str] = None, return_outputs: ReturnOutputs = False, **kwargs: Any) -> Any:
        """One training step: forward, loss and backward of ``pipe(*args, **kwargs)``, in the
        pipeline's ``schedule`` order; adds eager's gradients on the whole batch to ``.grad``
        and returns the step's loss (0-dim, no grad).

        The loss is the model's own (the 0-dim output merged with ``'mean'`` or ``'sum'``,
        ``labels=`` losses) when ``loss_fn`` is None, else ``loss_fn(output)`` or
        ``loss_fn(output, target)`` per micro-batch (``target`` split along dim 0). How the
        micro-batch losses add up to the whole batch's is read from ``loss_fn``'s own code
        (:mod:`fxpipe.checks._loss_fn`): a sum over samples is summed, a mean is weighted by
        what it divides by (samples, counted labels, a mask's sum, the targets' class
        weights). ``loss_reduction`` (``'mean'`` / ``'sum'``), if given, must agree with that
        reading. A loss that does not split (in-batch negatives) is computed on the merged
        output under GPipe and refused under ``schedule='1f1b'``, whose backward runs per
        micro-batch as soon as its forward is done (:mod:`fxpipe.runtime._orders`).
        Refusals: :class:`~fxpipe.errors.StepError`.

        ``return_outputs``: ``True`` returns ``(loss, outputs)``, the outputs merged as
        ``pipe(x)`` merges them and detached (each micro-batch's kept as it leaves the last
        stage, its activations freed as usual); a callable ``fn(output)`` returns ``(loss,
        [fn(output_i) for each micro-batch])``, computed under ``no_grad`` as each arrives, so
        only its result is kept (accuracy counts without holding the logits).
        """
        given = [k for k, v in (("loss_fn", loss_fn), ("target", target), ("loss_reduction", loss_reduction))
                 if v is not None] + (["return_outputs"] if return_outputs is not False else [])
        return run_step(self, args, kwargs, loss_fn, target, loss_reduction, given, return_outputs)

    def _loss_reading(self, loss_fn: Callable[..., torch.Tensor]) -> LossFnReading:
        """The reading of ``loss_fn`` kept for this pipeline (a few, the latest first): a lambda
        made anew per step with the same code and captured values is the same loss."""
        key, readings = loss_key(loss_fn), self._active.loss_readings
        reading = readings.pop(key, None)
        if reading is None:
            reading = LossFnReading(loss_fn, out_dims_of(self.batching.merges), self.capture.unflatten_output)
        readings[key] = reading
        while len(readings) > 8:
            readings.pop(next(iter(readings)))
        return reading

    def _micro_batches(self, args: tuple, kwargs: dict) -> Tuple[List[Any], List[List[Any]], List[int], Any,
                                                                  List[Batch]]:
        """A call's checks, then its flat inputs, micro-batches, sizes, loss weights and batches."""
        refuse_whole_pipeline_compile()  # torch.compile(pipe): a typed error naming stage.compile()
        if self.meta:
            raise refuse_running(self.n_stages)
        # The model's mode is the truth: model.eval() alone (not pipe.eval()) switches the
        # stages' modules, so the pipeline follows it rather than its own flag.
        self.training = self.module.training
        self._follow_modes()  # a graph with the modes baked in: the capture made for the modes set now
        self._active.dtypes.check()  # parameters given another dtype where the graph names the old one
        self.batching.refuse_mode(self.training)  # the build's training-mode check failed: eval only
        self._active.model_check.check()  # a submodule, parameter or traced attribute replaced since the build
        flat = self.capture.flatten_inputs(args, kwargs)  # checks structure and specialised values
        self.capture.check_context(self.module, args, kwargs, flat, self.devices[0])  # autocast, grad mode, dtypes the code read
        micro, sizes = self.batching.split(flat, self.chunks)
        self.capture.check_micro_batches(args, kwargs, micro)  # export's guards on the batch's size
        if self.capture.batch_fixed and max(sizes, default=1) > 1:
            raise InputMismatchError(
                f"this call's micro-batches hold {max(sizes)} samples, but torch.export captured the model on a "
                "batch-1 sample and fixed the batch at 1 (torch.export specialises a size of 1): every micro-batch "
                f"must hold one sample here (a batch of at most chunks={self.chunks}). Build from a sample of 2 or "
                "more samples: the pipeline then takes any batch size")
        weights = self.batching.weights(flat, micro)  # refuses ignored labels a 'mean' loss cannot weigh
        first = self.devices[0]
        batches = [
            Batch(tuple(x.to(first, non_blocking=True) if isinstance(x, torch.Tensor) else x for x in leaves), atomic=False)
            for leaves in micro
        ]
        return flat, micro, sizes, weights, batches

    def extra_repr(self) -> str:
        order = f", schedule={self.schedule!r}" if self.schedule != "gpipe" else ""
        return (f"n_stages={self.n_stages}, chunks={self.chunks}, checkpoint={self.checkpoint!r}{order}, "
                f"devices={self.devices}")


def pipeline(
    model: nn.Module,
    sample: Any,
    n_stages: int,
    *,
    sample_kwargs: Optional[dict] = None,
    chunks: int = 1,
    devices: Optional[Iterable[Device]] = None,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    balance_by: str = "time",
    leaf_modules: Sequence[Union[type, str]] = (),
    split_points: Optional[Sequence[str]] = None,
    plan: Optional[Union[Plan, str, os.PathLike]] = None,
    chunk_dims: ChunkDims = 0,
    output_merge: Optional[OutputMerge] = None,
    compile: CompileOption = False,
    progress: ProgressOption = True,
    schedule: str = "gpipe",
) -> Pipeline:
    """Turns ``model`` into a GPipe pipeline of ``n_stages`` stages.

    Args:
        model: any ``nn.Module``; it is traced with torch.fx (torch.export as a fallback).
        sample: an example input: a tensor, or a tuple of positional arguments.
        n_stages: number of pipeline stages.
        sample_kwargs: keyword arguments of the example call.
        chunks: number of micro-batches per mini-batch.
        devices: one device per stage (default: the CUDA devices, else CPU).
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``.
        deferred_batch_norm: BatchNorm running statistics per mini-batch.
        balance_by: ``'time'`` (profiled forward+backward), ``'memory'`` (activation and
            parameter bytes) or ``'params'`` (parameter bytes; deterministic, no profiling).
            A model built on the meta device is planned by ``'params'`` or ``'memory'``
            (sizes from shapes, nothing allocated); the pipeline returned cannot run.
            ``'time'`` measures, so two builds may split the model differently (timing
            noise), and another split draws other dropout masks per micro-batch from the
            same seed: to reproduce a run, reuse the plan (``plan=``) or use ``'params'``.
        leaf_modules: module classes or qualified names kept opaque.
        split_points: qualified module names to cut before (``n_stages - 1`` of them);
            overrides balancing.
        plan: a saved :class:`Plan` (object or JSON path) to reuse; no profiling.
        chunk_dims: the dim each input is split along: an int for all, or
            ``{argument name: dim or None}`` (None: every micro-batch gets it whole).
        output_merge: how each output's micro-batch values combine: a dim to concatenate
            along (default 0), ``'sum'``, ``'mean'``, ``'first'`` or a callable on the list of
            values; one for all, or ``{output name: merge}`` (``'loss'``, ``'0'``, ``'a.b'``).
            Both are verified on the sample when the pipeline is built.
        compile: ``True`` compiles each stage with ``torch.compile`` (lazily, at its first
            call); a dict passes torch.compile's keyword arguments (``{'mode': 'max-autotune'}``).
            Portals, phonies, copies and checkpointing stay outside the compiled code, so the
            result is as exact as the uncompiled pipeline (up to the compiler's reassociation).
        progress: ``True`` (default) shows the build's phases as a status line with a bar
            while stderr is a terminal; ``False`` shows nothing. Each phase is also logged at
            INFO on the ``"fxpipe"`` logger; setting that logger to WARNING turns the bar off
            too (:mod:`fxpipe.progress`).
        schedule: the order of a training step. ``'gpipe'`` (default, the paper's): every
            forward, then backward, which ``pipe(x)`` and the user's ``loss.backward()`` run.
            ``'1f1b'``: each micro-batch's backward as soon as its forward left the last
            stage, so stage ``j`` holds at most ``n_stages - j`` micro-batches' activations;
            only :meth:`Pipeline.step` can run it (``pipe(x)`` with gradients in training
            mode is refused). Both give eager's loss and gradients.

    Raises:
        fxpipe.TraceError: the model cannot be captured (the message says where and what to do).
        fxpipe.errors.MicroBatchError: splitting the sample and merging the outputs does not
            give the model's result (set ``chunk_dims`` / ``output_merge``).
        fxpipe.errors.MutationError: an in-place update that cannot be made exact.
        fxpipe.errors.MetaDeviceError: ``balance_by='time'`` on a model on the meta device.
        fxpipe.errors.ArgumentError: a bad argument (``StagesError``: ``n_stages``;
            ``SplitPointsError``: ``split_points``, or ``split_points`` with ``plan``); a ``ValueError``.
        fxpipe.errors.PlanModelError: a plan that does not match the model (a ``ValueError``).
        fxpipe.errors.DevicesError: fewer devices than stages (an ``IndexError``).
    """
    _check_args(model, n_stages, chunks, checkpoint, balance_by, split_points, plan)
    schedule = check_schedule(schedule)
    chunks = check_chunks(chunks)  # an int from here on (chunks=4.0 is 4)
    compile_options = check_compile_option(compile)
    report = as_progress(progress)
    device_list = _devices(devices, n_stages)
    check_graph_replay(compile_options, device_list)
    args: Tuple[Any, ...] = sample if isinstance(sample, tuple) else (sample,)
    options = BuildOptions(n_stages, chunks, device_list, balance_by, leaf_modules, split_points, plan, chunk_dims,
                           output_merge, report)
    kwargs = dict(sample_kwargs or {})
    # Stages on several devices: the model cannot run whole after placement, so the other root
    # mode is captured now (fxpipe._mode_variants); on one device, on first need.
    several = len(set(device_list)) > 1
    built = build(model, args, kwargs, options, flipped=several)  # fxpipe.build: the one build sequence
    if compile_options is not None:
        compile_stages(built.stages, compile_options)
    kept = None if several or not built.mode_sensitive else _kept_sample(args, kwargs)
    return Pipeline(model, built.capture, built.plan, built.stages, device_list, chunks, checkpoint,
                    deferred_batch_norm, built.mode_sensitive, built.batching, meta=built.meta, schedule=schedule,
                    sample=kept, options=options, compile_options=compile_options, prepared=built.flipped)


def _kept_sample(args: Tuple[Any, ...], kwargs: dict) -> Tuple[Tuple[Any, ...], dict]:
    """The sample, copied, for a later capture in other modes (the caller may reuse its tensors)."""
    def kept(v: Any) -> Any:
        return v.detach().clone() if isinstance(v, torch.Tensor) else v
    return pytree.tree_map(kept, (args, kwargs))


def _default_batching(model: nn.Module, captured: Capture) -> Batching:
    n_in = captured.in_spec.num_leaves
    return Batching(["input"] * n_in, [0] * n_in, [""] * captured.out_spec.num_leaves,
                    [None] * captured.out_spec.num_leaves)
