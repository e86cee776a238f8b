"""The one build sequence: capture -> checks -> plan (or load and check one) -> emit and place.

``fxpipe.pipeline``, ``fxpipe.distributed.pipeline`` and the command line's ``plan`` /
``render`` / ``code`` all build through here, so each refuses what the others refuse, with
the same message: before there was one sequence, the command line skipped the micro-batch
checks and printed plans the library would refuse. The steps are separate functions because
the callers differ in one place each:

* :func:`capture_and_check` -- the model captured exactly and its micro-batching verified
  on the sample (every caller);
* :func:`choose_plan` -- a saved plan loaded and checked against the capture, or one made
  (``fxpipe.distributed`` runs it on rank 0 only and broadcasts the result);
* :func:`emit_and_place` -- one stage module per stage, on its device (the distributed
  build emits from a plan with carried portals instead, and places per rank).

:func:`build` runs them in order for one process and returns a :class:`Built`. Call the steps
inside ``preserved(model)`` (:func:`build` does): they run the model, and building must leave
it as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn

from .capture._meta import is_meta_model, refuse_timing, to_meta
from .capture._mode_flags import flags_of, modes_kept
from .capture._kept_together import check_kept_together
from .capture._prepare import Prepared, prepare, preserved, written_kept
from .capture._signature import sample_mismatch
from .capture._tracing import Capture
from .checks._backward_mixing import refuse_backward_mixing
from .checks._batching import Batching, ChunkDims, OutputMerge, input_split_dims
from .checks._modes import check_modes
from .checks._running_totals import refuse_running_totals
from .emit._placement import place_stages
from .emit._stage_state import mutable_state
from .emit._stages import Stages, emit_stages
from .errors import (ArgumentError, FxpipeError, MicroBatchError, MutationError, PlanModelError, SplitPointsError,
                     TraceError)
from .plan._carry_over import CarryError, carry_assignment
from .plan._make import make_plan
from .plan._op_graph import build_opgraph
from .plan._recorded import RecordedRun
from .plan._value import Plan
from .progress import Progress

__all__ = ["BuildOptions", "Checked", "Built", "build", "capture_and_check", "choose_plan", "emit_and_place",
           "check_plan", "check_split_points", "plan_carried_over", "CarryError", "capture_flipped", "recapture"]

PlanOption = Union[Plan, str, "os.PathLike[str]", None]


@dataclass
class BuildOptions:
    """What a build is asked for (checked by the front door that took them)."""

    n_stages: int
    chunks: int = 1
    #: one per stage; None: planned without devices (the command line's plan and render)
    devices: Optional[List[torch.device]] = None
    balance_by: str = "time"
    leaf_modules: Sequence[Union[type, str]] = ()
    split_points: Optional[Sequence[str]] = None
    plan: PlanOption = None
    chunk_dims: ChunkDims = 0
    output_merge: Optional[OutputMerge] = None
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    #: torch.export only, not torch.fx first: a capture in other modes of a model first captured
    #: by export (:mod:`fxpipe._mode_variants`)
    export_only: bool = False


@dataclass
class Checked:
    """A capture that passed the checks: the graph, how to batch it, and the sample it ran on
    (moved to the meta device for a model there)."""

    prepared: Prepared
    batching: Batching
    args: Tuple[Any, ...]
    kwargs: dict
    meta: bool
    #: the check's run of the first micro-batch, for the plan to profile from (consumed by
    #: :func:`choose_plan`): :mod:`fxpipe.plan._recorded`
    recorded: Optional[RecordedRun] = None

    @property
    def capture(self) -> Capture:
        return self.prepared.capture


@dataclass
class Built:
    """What :func:`build` returns: every value of the data path, each printable on its own."""

    capture: Capture
    batching: Batching
    plan: Plan
    #: the emitted stages, placed on their devices (None when built with ``emit=False``)
    stages: Optional[Stages]
    #: why the graph cannot follow a mode switch ('' when it can): :mod:`fxpipe.capture._prepare`
    mode_sensitive: str
    #: built from a model on the meta device (planned and emitted, not runnable)
    meta: bool
    #: with ``build(flipped=True)`` and a graph with the modes baked in: the model captured with
    #: the root's mode flipped, ``(flags, Checked or the error, Plan carried over or None)``
    flipped: Optional[Tuple[Tuple[bool, ...], Any, Optional[Plan]]] = None


def check_split_points(split_points: Optional[Sequence[str]], plan: Any) -> None:
    """``split_points`` is a list of module names, and not given together with ``plan``
    (a plan fixes every cut already: one of them would be ignored)."""
    if split_points is None:
        return
    if plan is not None:
        raise SplitPointsError(
            "plan= and split_points= were both given, but a plan already fixes where the stages are cut, "
            "so split_points would be ignored; pass one of them: plan= to reuse a saved plan, or "
            "split_points= (without plan=) to cut before those modules", argument="split_points")
    if isinstance(split_points, (str, bytes)) or not all(isinstance(n, str) for n in split_points):
        raise SplitPointsError(
            f"split_points must be a list of qualified module names (n_stages - 1 of them, e.g. "
            f"['layers.4', 'layers.8']), got {split_points!r}", argument="split_points")


def check_plan(plan: Plan, captured: Capture, n_stages: int, path: Optional[str] = None) -> None:
    """A given plan fits this capture: its stage count and exactly this graph's nodes.

    Raises :class:`~fxpipe.errors.PlanModelError` (a ``ValueError``) naming ``path``, the
    file the plan came from (``None``: a Plan object).
    """
    where = f"the plan in {path!r}" if path else "the plan"
    if plan.n_stages != n_stages:
        raise PlanModelError(f"{where} has {plan.n_stages} stages but n_stages={n_stages}; pass "
                             f"n_stages={plan.n_stages}, or make a new plan for {n_stages} stages (omit plan=...)",
                             path=path)
    nodes = {n.name for n in captured.graph_module.graph.nodes}
    missing = sorted(nodes - set(plan.assignment))
    extra = sorted(set(plan.assignment) - nodes)
    if missing or extra:
        raise PlanModelError(
            f"{where} does not match this model's graph "
            f"(nodes without a stage: {missing[:5]}, unknown nodes: {extra[:5]}); it was made for another "
            "model, another configuration or another fxpipe/torch version: "
            "make a new plan for this model (omit plan=...)", path=path
        )


def _refuse_inference_state(model: nn.Module) -> None:
    """Parameters or buffers created under ``torch.inference_mode()`` cannot be built on (their
    versions are not tracked, they cannot be saved for backward); nor can a lazy module's, which
    have no shape until the model's first call (torch's bare "uninitialized parameter" error)."""
    from torch.nn.parameter import is_lazy

    lazy = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        raise ArgumentError(
            f"{type(model).__name__}'s {', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''} "
            f"{'are' if len(lazy) > 1 else 'is'} not initialised yet (a lazy module: nn.LazyLinear, nn.LazyConv2d, "
            "...), which have no shape until the model's first call. What to do: call the model once on a batch "
            "(model(sample)) before building the pipeline, as before creating an optimizer", argument="model")
    bad = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_inference()]
    if bad:
        raise ArgumentError(
            f"{type(model).__name__}'s {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} "
            f"{'are inference tensors' if len(bad) > 1 else 'is an inference tensor'} (created under "
            "torch.inference_mode()), which a pipeline cannot be built on: create the model (or load its "
            "weights) outside torch.inference_mode(); the built pipeline may then be called inside it",
            argument="model")


def _normal_tensors(args: Tuple[Any, ...], kwargs: dict) -> Tuple[Tuple[Any, ...], dict]:
    """The sample with its inference tensors cloned into normal ones (same values).

    A sample made under ``torch.inference_mode()`` is an inference tensor: the build, which
    runs outside inference mode, could not save it for the profiled backward nor track its
    versions (fxpipe.capture._mutation). The caller's tensors are left as they are.
    """
    def normal(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v
    return pytree.tree_map(normal, (args, kwargs))


def capture_and_check(model: nn.Module, args: Tuple[Any, ...], kwargs: dict, options: BuildOptions, *,
                      record: bool = False) -> Checked:
    """The model captured exactly, and its split/merge verified on the sample (whole run vs
    split into micro-batches and merged; graph vs eager), in eval and in training mode
    (:mod:`fxpipe.checks._modes`). Call it inside ``preserved(model)``: it runs the model.
    ``record``: a plan is to be made next (:func:`choose_plan`): the check's run of the first
    micro-batch is recorded for its profile (:mod:`fxpipe.plan._recorded`)."""
    report = options.progress
    _refuse_inference_state(model)
    args, kwargs = _normal_tensors(args, kwargs)
    meta = is_meta_model(model)
    if meta:  # shapes only: size it, never time it; the sample meets meta weights on meta
        if options.plan is None and options.balance_by == "time":
            refuse_timing()
        args, kwargs = to_meta(args, kwargs)
    mismatch = sample_mismatch(model, args, kwargs)
    if mismatch:  # else the capture fails on the call and advises about untraceable code
        raise ArgumentError(
            f"the sample does not fit the model: {mismatch}. What to do: pass the sample as the model is "
            "called: sample= its positional input (a tuple for several), sample_kwargs= its keyword "
            "arguments.", argument="sample")
    _, split_dims = input_split_dims(model, args, kwargs, options.chunk_dims)
    try:
        prepared = prepare(model, args, kwargs, options.leaf_modules, split_dims, report, options.export_only)
    except Exception as e:
        _refuse_failing_sample(model, args, kwargs, e)  # the model's own error first, when it has one
        raise
    recorded = None
    if record and options.plan is None and options.balance_by in ("time", "params") and not meta:
        recorded = RecordedRun(prepared.capture.graph_module, timed=options.balance_by == "time")
    with report.phase("checking micro-batches against the whole batch"), \
            written_kept(model, prepared.mutations.state_names()):
        try:
            batching = check_modes(model, prepared, args, kwargs, options.chunk_dims, options.output_merge,
                                   options.chunks, record=recorded)
        except RuntimeError as e:
            _refuse_written_weights(model, prepared, e)
            raise
    refuse_backward_mixing(prepared.capture.graph_module, options.chunks)
    refuse_running_totals(prepared.capture.graph_module, prepared.capture.flatten_inputs(args, kwargs),
                          split_dims, options.chunks)
    if options.chunks > 1 and batching.batch_size(prepared.capture.flatten_inputs(args, kwargs)) == 1:
        raise MicroBatchError(
            f"the sample holds one sample along {batching.dims_text()}, and chunks={options.chunks} splits every batch "
            "into micro-batches: a sample of one cannot show that micro-batches give the whole batch's result (a "
            "module that mixes the samples would train a silently different model). Build from a sample of 2 or "
            "more samples (two rows of your data); the pipeline then takes any batch size, and any length "
            "the capture allows. With chunks=1 (no micro-batches) a sample of one is enough.")
    return Checked(prepared, batching, args, kwargs, meta, recorded)


def _refuse_written_weights(model: nn.Module, prepared: Prepared, failure: RuntimeError) -> None:
    """After autograd refused a backward because a saved tensor was written in place: when the
    forward writes a weight that needs a gradient (``self.weight.clamp_(...)`` under no_grad, a
    max-norm renormalisation), that is the cause. Eager's one forward writes it before using it;
    a pipeline runs the next micro-batch's forward, which writes it again, before the earlier
    micro-batch's backward, which needs it as it was. Refused as a :class:`MutationError` naming
    the weight and the line, instead of autograd's bare error from inside the checks."""
    if "modified by an inplace operation" not in str(failure):
        return
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    written = [s for s in prepared.mutations.state if s.name in trained]
    if not written:
        return
    first = written[0]
    writer = next(n for n in prepared.capture.graph_module.graph.nodes if n.name == first.writers[0])
    by = f"module `{writer.target}` ({type(prepared.capture.graph_module.get_submodule(writer.target)).__name__})" \
        if writer.op == "call_module" else f"`{writer.format_node()}`"
    raise MutationError(
        f"{first.where}: {by} writes the parameter `{first.name}` in place in forward, and a backward "
        f"uses its value from the forward. A pipeline runs the next micro-batch's forward, which writes it "
        f"again, before the earlier micro-batch's backward: autograd refuses that ({_first_line(failure)}). "
        f"What to do: apply the constraint to the weight outside forward (after optimizer.step(), under "
        f"torch.no_grad()), or compute the constrained weight out of place "
        f"(torch.nn.utils.parametrize.register_parametrization).",
        node=first.writers[0]) from failure


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0].split(". Hint")[0].rstrip(".")


def _refuse_failing_sample(model: nn.Module, args: Tuple[Any, ...], kwargs: dict, failure: Exception) -> None:
    """After a failed capture: the model run eagerly on the sample. A model that fails there
    too (labels of the wrong shape) was given a sample it rejects, whatever the capture said
    about untraceable code: that error leads, as a :class:`TraceError` naming it."""
    if isinstance(failure, FxpipeError) and not isinstance(failure, TraceError):
        return  # a refusal of fxpipe's own that names its cause
    try:
        with torch.enable_grad():  # as the capture ran it (no_grad fails a hook registered in forward)
            model(*args, **kwargs)
    except Exception as own:  # noqa: BLE001 - the model's own error, whatever it is
        first = (str(own).strip().splitlines() or [""])[0].rstrip(".")
        raise TraceError(
            f"the model itself fails on the sample: {type(own).__name__}: {first}. fxpipe captures the model by "
            f"running it on the sample, so the sample must be one the model accepts: check the sample's shapes "
            f"and arguments (model(*sample, **sample_kwargs) raises the same). The capture's own error follows "
            f"as the cause.", reason=f"{type(own).__name__}: {first}") from own
    return


def choose_plan(checked: Checked, options: BuildOptions) -> Plan:
    """The plan given (loaded, and checked against this capture) or one made for it; either
    way checked to keep together what a cut must not separate."""
    captured, given = checked.capture, options.plan
    if given is not None:
        chosen = given if isinstance(given, Plan) else Plan.load(given)
        check_plan(chosen, captured, options.n_stages, None if isinstance(given, Plan) else str(os.fspath(given)))
    else:  # sizing and profiling run the graph: weights its forward writes in place are put back after
        with written_kept(captured.graph_module, checked.prepared.mutations.state_names()):
            chosen = make_plan(captured, checked.args, checked.kwargs, options.n_stages,
                               balance_by=options.balance_by, split_points=options.split_points,
                               devices=options.devices or (), chunks=options.chunks, batching=checked.batching,
                               progress=options.progress, recorded=checked.recorded)
    checked.recorded = None  # its kept inputs are activations: not held past the plan
    check_kept_together(captured.graph_module, chosen.assignment)
    return chosen


def plan_carried_over(plan: Plan, planned: Capture, captured: Capture) -> Plan:
    """``plan``, made for the capture ``planned``, carried over to ``captured``: another capture of
    the same model (in other modes), cut in the same places (:mod:`fxpipe.plan._carry_over`).
    Raises :class:`CarryError` (a ``ValueError``) when the graphs differ too much to carry it."""
    new = build_opgraph(captured.graph_module)
    assignment = carry_assignment(build_opgraph(planned.graph_module), plan.assignment, new)
    try:
        carried = Plan.from_assignment(new, assignment, balance_by=plan.balance_by, meta=plan.meta)
    except ValueError as e:
        raise CarryError(str(e)) from None
    if carried.n_stages != plan.n_stages:
        raise CarryError(f"the carried cut has {carried.n_stages} stages, the plan {plan.n_stages}")
    try:
        check_kept_together(captured.graph_module, carried.assignment)
    except FxpipeError as e:
        raise CarryError(str(e)) from None
    return carried


def emit_and_place(model: nn.Module, captured: Capture, plan: Plan, devices: List[torch.device],
                   progress: Progress) -> Stages:
    """One stage module per stage, each knowing the state its recomputation must snapshot,
    its parameters and buffers on its device (the model's own tensors, moved, not copied)."""
    with progress.phase("emitting stages"):
        stages = emit_stages(captured.graph_module, plan)
        for stage in stages:
            stage.mutable_state = mutable_state(model, stage)
        place_stages(stages, devices, exported=captured.method == "export")
    return stages


def build(model: nn.Module, args: Tuple[Any, ...], kwargs: dict, options: BuildOptions, *,
          emit: bool = True, flipped: bool = False) -> Built:
    """The whole sequence for one process: capture and check, plan, then (``emit``) emit and
    place on ``options.devices``. Runs outside inference mode whatever the caller's (the build
    runs backward to profile and tracks in-place updates by version counters), and leaves the
    model as it was. ``flipped``: where the graph bakes the modes in, also capture the model with
    the root's mode flipped, before placing (:mod:`fxpipe._mode_variants`)."""
    other = None
    with torch.inference_mode(False):
        with preserved(model):  # building runs the model; none of it may show afterwards
            checked = capture_and_check(model, args, kwargs, options, record=True)
            plan = choose_plan(checked, options)
            if flipped and checked.prepared.mode_sensitive and not checked.meta:
                other = capture_flipped(model, checked, plan, options)
        stages = None
        if emit:
            if options.devices is None:
                raise ValueError("build(emit=True) needs options.devices: one device per stage")
            stages = emit_and_place(model, checked.capture, plan, options.devices, options.progress)
    return Built(checked.capture, checked.batching, plan, stages, checked.prepared.mode_sensitive, checked.meta,
                 other)


def recapture(model: nn.Module, args: Tuple[Any, ...], kwargs: dict, options: BuildOptions, plan: Plan,
              planned: Capture) -> Tuple[Checked, Plan]:
    """The model captured and checked again with the flags it has now (torch.export where
    ``planned`` was, :attr:`BuildOptions.export_only`), and ``plan``, made for ``planned``,
    carried over to it. Call inside ``preserved(model)``."""
    with torch.enable_grad():
        checked = capture_and_check(model, args, kwargs, replace(options, export_only=planned.method == "export"))
        return checked, plan_carried_over(plan, planned, checked.capture)


def capture_flipped(model: nn.Module, checked: Checked, plan: Plan, options: BuildOptions
             ) -> Tuple[Tuple[bool, ...], Any, Optional[Plan]]:
    """The model captured and checked with the root's mode flipped (every module with it), and
    ``plan`` carried over; or the error that stopped it, kept for the call that needs it. Call
    inside ``preserved(model)``; the modes are back as they were on return."""
    with modes_kept(model):
        model.train(not model.training)
        flags = flags_of(model.modules())
        try:
            return (flags, *recapture(model, checked.args, checked.kwargs, options, plan, checked.capture))
        except (FxpipeError, CarryError) as e:
            return flags, e, None
