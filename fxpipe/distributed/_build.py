"""``fxpipe.distributed.pipeline``: one automatic plan, run by one process per stage.

Every rank builds the same model and calls :func:`pipeline` with the same arguments. Each
captures and checks the model exactly as ``fxpipe.pipeline`` does (the same steps of
:mod:`fxpipe.build`); rank 0 alone plans (:func:`fxpipe.build.choose_plan`) and broadcasts the plan
(:mod:`._agree`); every rank carries the plan's portals through the stages in between
(:mod:`._carry`), emits all stages, checks their code against the other ranks', finds the
static boundary metadata with one fake run (:mod:`._meta`) and wraps its own stages in
torch.distributed.pipelining ``PipelineStage``s under a torch schedule.
"""

from __future__ import annotations

from datetime import timedelta
import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fxpipe.build import BuildOptions, capture_and_check, check_plan, check_split_points, choose_plan
from fxpipe.capture._tracing import retarget_devices
from fxpipe.checks._loss_fn import LossFnReading, out_dims_of
from fxpipe.emit._compiling import CompileOption, check_compile_option, compile_stages
from fxpipe.emit._placement import move_in_place, stage_tensors
from fxpipe.emit._stages import Stages, emit_stages
from fxpipe.checks._batching import OutputMerge
from fxpipe.errors import MicroBatchError, StepError
from fxpipe.runtime._frontend import CHECKPOINT_MODES, check_chunks, checkpoint_stop
from fxpipe.capture._kept_together import check_kept_together
from fxpipe.plan._value import Plan
from fxpipe.plan._make import BALANCE_BY
from fxpipe.capture._prepare import preserved
from fxpipe.progress import Progress, ProgressOption, as_progress

from ._agree import agree_on_arguments, agree_on_stages, broadcast_plan
from ._seeds import warn_same_draws
from ._carry import carried_plan
from ._device import DeviceOption, check_one_gpu_per_rank, ensure_process_group, rank_device
from ._eval_mode import capture_eval, eval_run
from ._eager_guard import guard_eager, unguard_eager
from ._failures import Failures, joining
from ._loss import StepLoss
from ._materialise import InitBuffers, check_sample, local_weights
from ._mesh import layout_of, refuse_replicated_state
from ._sharding import refuse_sharded_model, shard_stages, sharded_here, sharded_stage
from ._symbolic_meta import ShapeMetas
from ._pipe import DistributedPipeline
from ._schedules import SCHEDULES, check_schedule, make_schedules, rank_of_stage, stages_of_rank
from ._shape_runs import ShapeRuns, TrainRun, micro_batch
from ._sources import StateDictSource
from ._split_backward import backward_pass
from ._ties import TiedGradients, tied_across_ranks
from ._values import stage_runners
from ._weights import partly_released, release_others, restore_released

__all__ = ["pipeline", "SCHEDULES", "DEFAULT_TIMEOUT"]

#: seconds a rank waits for its peers in any collective or transfer of the pipeline
DEFAULT_TIMEOUT = 300.0


class CheckpointedStage(PipelineStage):
    """A ``PipelineStage`` that tells its :class:`StageRunner` which micro-batch it runs
    (torch's schedules pass the micro-batch index as ``fwd_chunk_id``), so the runner can
    checkpoint the chosen ones, and whose zero-bubble input pass misses no weight gradient."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.micro_batch, self.submod.index = fwd_chunk_id, self.stage_index
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        """Zero bubble's input-gradient pass made exact for every parameter, and the input
        gradients sent contiguous (:mod:`._split_backward`). A stage FSDP shards
        (``data_parallel='fsdp'``) keeps its gradients whole until :meth:`perform_reduce_grad`,
        as torch's stage does for an FSDP submodule (ours is the runner around it)."""
        sharded = sharded_stage(self.submod)
        if sharded is not None:
            sharded.set_is_last_backward(False)
            sharded.set_reshard_after_backward(False)
            sharded.set_requires_gradient_sync(False)
        run = super().backward_maybe_with_nosync
        return backward_pass(backward_type, bwd_kwargs, list(self.submod.parameters()),
                             lambda: run(backward_type, bwd_kwargs, last_backward))

    def _post_metadata_inference_cleanup(self) -> None:
        """torch's schedule calls this at a stage's first step (torch 2.13): it reshards FSDP
        modules and sets every one of their parameters' ``.grad`` to None, dropping the stale
        gradients of a *dynamic* metadata inference. fxpipe's stages take static metadata (no
        such run), so the gradients there are those earlier steps accumulated: a new shape's
        stage (a new sequence length) or the first ``eval_step`` between two accumulated steps
        under ``'fsdp'`` would drop them. Kept as they were."""
        kept = [(p, p.grad) for p in self.submod.parameters() if p.grad is not None]
        cleanup = getattr(super(), "_post_metadata_inference_cleanup", None)
        if cleanup is not None:
            cleanup()
        for p, grad in kept:
            p.grad = grad

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """After the step's last backward: torch's own reduction of an FSDP submodule's
        gradients (one reduce-scatter per step), run on the sharded stage inside the runner."""
        sharded = sharded_stage(self.submod)
        if sharded is None:
            return super().perform_reduce_grad(grad_scale_factor)
        runner, self.submod = self.submod, sharded
        try:
            return super().perform_reduce_grad(grad_scale_factor)
        finally:
            self.submod = runner


def capture_sample(model: nn.Module, sample: Any) -> Any:
    """The sample where the model is, for the capture (which may run the model): a CPU model
    and a GPU sample, or the reverse, would fail inside the model. A model on meta (captured
    on a meta copy), or spread over devices, takes the sample as it is."""
    devices = {t.device for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    if len(devices) != 1:
        return sample
    (where,) = devices
    return pytree.tree_map(lambda x: x.to(where) if isinstance(x, torch.Tensor) and x.device != where else x, sample)


def _check_timeout(timeout: float) -> timedelta:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def _check_args(model: nn.Module, chunks: int, loss_fn: Any, schedule: str, stages_per_rank: int,
                balance_by: str, checkpoint: str, pipeline_ranks: int) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    chunks = check_chunks(chunks)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), or None for the model's own loss, "
                        f"got {type(loss_fn).__name__}")
    check_schedule(schedule, stages_per_rank, chunks, pipeline_ranks)
    if balance_by not in BALANCE_BY:
        raise ValueError(f"balance_by must be one of {', '.join(map(repr, BALANCE_BY))}, got {balance_by!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {checkpoint!r}")


def _own_loss_default(capture: Callable[[], Any], defaulted: bool) -> Any:
    """``capture()``; with ``loss_fn=None`` and no ``output_merge``, the default
    ``{'loss': 'mean'}`` naming no output is said as what it is: no loss to train."""
    try:
        return capture()
    except MicroBatchError as e:
        if defaulted and "output_merge names ['loss']" in str(e):
            raise StepError("loss_fn=None trains the model's own loss, and this model returns no output named "
                            "'loss' (transformers' returns one when called with labels=). Pass loss_fn=..., or "
                            "output_merge={'<its loss output>': 'mean'}") from e
        raise


def pipeline(
    model: nn.Module,
    sample: Any,
    *,
    chunks: int,
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
    output_merge: Optional[OutputMerge] = None,
    schedule: str = "gpipe",
    stages_per_rank: int = 1,
    sample_kwargs: Optional[dict] = None,
    plan: Optional[Union[Plan, str, os.PathLike]] = None,
    balance_by: str = "params",
    leaf_modules: Sequence[Union[type, str]] = (),
    split_points: Optional[Sequence[str]] = None,
    checkpoint: str = "except_last",
    timeout: float = DEFAULT_TIMEOUT,
    state_dict: Optional[StateDictSource] = None,
    init_buffers: Optional[InitBuffers] = None,
    device: DeviceOption = None,
    progress: ProgressOption = True,
    compile: CompileOption = False,
    mesh: Any = None,
    data_parallel: Optional[str] = None,
) -> DistributedPipeline:
    """This rank's part of ``model`` run as a pipeline of ``world_size * stages_per_rank`` stages
    (with ``mesh=``: ``pp * stages_per_rank`` stages, ``dp`` replicas of that pipeline).

    Call it on every rank, with the same model (same class, config and seed) and the same
    arguments. Under torchrun with no process group yet, it starts one: NCCL with each rank
    on ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on the CPU; a group you started
    is used as it is, the rank running where its backend sends from (:mod:`._device`). The
    tensors of this rank's stages move to its device in place; the sample and ``step``'s
    inputs may be given on the CPU. Rank 0's parameters
    and buffers are broadcast to every rank first, as DDP does; or, with ``state_dict=``,
    each rank loads only its own stages' tensors -- the way to run a model built on the meta
    device, of which each rank then materialises only its own stages
    (:mod:`fxpipe.distributed._materialise`). To train under ``torch.autocast``, build under
    it too: the stages' buffers take the build's dtypes.

    Args:
        model, sample, sample_kwargs, leaf_modules, split_points: as for :func:`fxpipe.pipeline`.
        chunks: micro-batches per mini-batch; must divide the batch size of the sample and of
            each batch. Any length the capture takes and any such batch size run on this one
            pipeline: torch's stages are made per micro-batch shape and cached
            (:mod:`fxpipe.distributed._shape_runs`).
        loss_fn: ``loss_fn(output, target)`` on one micro-batch; ``output`` has the model's
            structure. It is read, not trusted: a sum over samples is summed, a mean is weighted
            by what it divides by (samples, the labels it counts after its own shift, a mask's
            sum, class weights), so ``step`` gives eager's loss and gradients on the whole
            batch; a loss that does not split (in-batch negatives) is refused before anything
            is sent (:mod:`fxpipe.distributed._loss`). None: the model's own loss (transformers'
            ``labels=``), weighed exactly as :func:`fxpipe.pipeline` merges it (counted labels
            included); ``step`` then takes no ``target``.
        output_merge: as for :func:`fxpipe.pipeline`, for the model's own loss: default
            ``{'loss': 'mean'}`` with ``loss_fn=None``. Other outputs are merged along dim 0.
        schedule: ``'gpipe'`` or ``'1f1b'``; with ``stages_per_rank > 1``: ``'gpipe'``
            (torch's LoopedBFS), ``'interleaved1f1b'`` or ``'interleavedzb'`` (interleaved zero
            bubble), stage ``k`` on rank ``k % world_size``; ``'zbv'`` (zero-bubble V) with
            ``stages_per_rank=2``: rank ``r`` holds stages ``r`` and ``2 * world_size - 1 - r``.
            See :mod:`fxpipe.distributed._schedules`.
        plan: a saved plan (object or JSON path), read on rank 0; no profiling.
        balance_by: as for :func:`fxpipe.pipeline`; default ``'params'`` (deterministic).
            ``'time'`` times one micro-batch of the sample, the unit every stage runs.
        checkpoint: ``'except_last'`` (default), ``'always'`` or ``'never'``, as for
            :func:`fxpipe.pipeline`: each checkpointed micro-batch's stage forward keeps no
            activations and is recomputed once in its backward (RNG and autocast state and
            buffers restored: dropout masks match), on every stage; under the zero-bubble
            schedules both backward passes use that one recomputation (:mod:`._recompute`).
        timeout: seconds any rank waits for its peers before the job fails (no hang).
        state_dict: the weights, read by each rank for its own stages only: a mapping, the path
            of a ``torch.save`` file (memory-mapped), the path of a ``torch.distributed.checkpoint``
            directory, or a callable ``keys -> mapping`` (:mod:`fxpipe.distributed._sources`).
            Needed for a model on the meta device (which is then planned by ``'params'`` or
            ``'memory'``, never timed).
        init_buffers: ``fn(name, module)`` recomputing a module's non-persistent buffers (in no
            checkpoint) after a meta model is materialised; default: a transformers model's own
            ``_init_weights``. A buffer left unwritten raises ``MaterialiseError``.
        device: where this rank runs: None (``cuda:LOCAL_RANK`` over NCCL, the CPU over
            gloo, as the process group's backend allows), ``'cuda'``, ``'cuda:N'`` or ``'cpu'``.
        progress: as for :func:`fxpipe.pipeline`; shown by rank 0 only (one terminal line).
        compile: as for :func:`fxpipe.pipeline`: ``True`` or torch.compile's keyword arguments
            compiles this rank's stages (lazily, at their first call; after the build's fake
            metadata run); the schedule, sends and recomputation stay eager around them.
        mesh: a ``DeviceMesh`` over every rank with dims named ``'dp'`` and ``'pp'``
            (``init_device_mesh(kind, (dp, pp), mesh_dim_names=('dp', 'pp'))``): the pipeline runs
            over ``'pp'``, and ``dp`` replicas of it each step on their own shard of the global
            batch (:meth:`DistributedPipeline.shard`); None: one pipeline over every rank.
        data_parallel: with a mesh of ``dp > 1``, ``'ddp'``: each replica holds its stages
            whole, and the step's gradients are summed over the replicas once per step, with
            the loss weighed over the global batch, so ``step`` gives eager's loss and
            gradients on the global batch (:mod:`fxpipe.distributed._replicas`). ``'fsdp'``:
            the same, each replica's stages sharded over the replicas with FSDP2, a rank
            holding ``1/dp`` of its stages' parameters, gradients and optimizer state
            (:mod:`fxpipe.distributed._sharding`).

    Raises:
        fxpipe.errors.DistributedError: no process group and no torchrun environment; a
            device the group's backend cannot send from; two ranks on one GPU; rank 0 could
            not plan.
        fxpipe.errors.PlanMismatchError: the ranks' stage code differs.
        fxpipe.errors.BatchShapeError: the sample's batch is not a multiple of ``chunks``.
        fxpipe.errors.MetaDeviceError: a model on meta without ``state_dict=``, or with
            ``balance_by='time'``; a sample on meta.
        fxpipe.errors.MaterialiseError: a key of this rank's stages missing from ``state_dict``
            (or of another shape), a non-persistent buffer nothing restores.
        and every error :func:`fxpipe.pipeline` raises for the model.
    """
    wait = _check_timeout(timeout)
    compile_options = check_compile_option(compile)  # before any collective: a bad option on every rank alike
    ensure_process_group(wait, device)
    with joining(wait):  # a rank building alone: said, not the store's bare timeout
        layout = layout_of(mesh, data_parallel, wait)  # collective: every rank, before any other check can differ
        _check_args(model, chunks, loss_fn, schedule, stages_per_rank, balance_by, checkpoint, layout.pp)
        chunks = check_chunks(chunks)  # an int from here on (chunks=4.0 is 4)
        check_split_points(split_points, plan)
        where = rank_device(device)
        check_one_gpu_per_rank(where, wait)  # before NCCL's first collective, which would stop on it
        report = as_progress(progress) if dist.get_rank() == 0 else Progress(enabled=False)
        world, group, pipe_group = layout.pp, layout.world, layout.pipe
        agree_on_arguments({"schedule": schedule, "chunks": chunks}, group)  # else a hang or an abort in a step
    n_stages = world * stages_per_rank
    args: tuple = sample if isinstance(sample, tuple) else (sample,)
    kwargs = dict(sample_kwargs or {})
    refuse_sharded_model(model)  # an earlier 'fsdp' pipeline's shards: nothing whole to build from
    unguard_eager(model)  # an earlier build's hook: the capture below must not trace it
    if partly_released(model):  # built before: each rank holds its stages' trained weights
        restore_released(model, group, where)
    merge = output_merge if output_merge is not None or loss_fn is not None else {"loss": "mean"}
    options = BuildOptions(n_stages, chunks, None, balance_by, leaf_modules, split_points, plan,
                           output_merge=merge, progress=report)
    with preserved(model):
        with Failures(group, where).agreed("capture and check its model and sample"):  # a bad sample on one rank
            check_sample(model, args, kwargs, state_dict=state_dict)
            args, kwargs = capture_sample(model, (args, kwargs))
            checked = _own_loss_default(lambda: capture_and_check(model, args, kwargs, options, record=True),
                                        loss_fn is None and output_merge is None)
            checked.batching.refuse_mode(True)  # step() trains: a failed training-mode check refuses the build
            refuse_replicated_state(checked.prepared.mutations.state_names(), layout)
            captured = checked.capture
            flat = captured.flatten_inputs(args, kwargs)
            micro = micro_batch(captured.flatten_inputs(checked.args, checked.kwargs), chunks, "the sample")

        # on rank 0; profiled on one micro-batch (fxpipe.plan._make.profiled_inputs)
        agreed = broadcast_plan(lambda: choose_plan(checked, options), group)
        checked.recorded = None  # kept for rank 0's plan only
        built: list[Stages] = []

        def build() -> list[str]:
            check_plan(agreed, captured, n_stages)
            check_kept_together(captured.graph_module, agreed.assignment)
            gm = captured.graph_module
            built.append(emit_stages(gm, carried_plan(gm, agreed)))
            return [built[0].stage_code(k, source=False) for k in range(n_stages)]

        agree_on_stages(build, group)
        found_eval, no_eval = None, ""
        if checked.prepared.mode_sensitive and model.training:  # eval_step after model.eval(): captured now
            found_eval, no_eval = capture_eval(model, checked, agreed, options, group, where, n_stages)
    stages = built[0]
    if captured.method == "export":  # export graphs bake in the capture's device (or meta): here, this rank's
        for stage in stages.modules:
            retarget_devices(stage, where)
        counted = checked.batching.counted  # and the code counting a loss's labels (labels.to(logits.device))
        for count in (counted.counts.values() if counted is not None else ()):
            retarget_devices(count.program, where)
    rank = dist.get_rank(pipe_group)
    placement = rank_of_stage(schedule, world, stages_per_rank)
    local = stages_of_rank(schedule, world, stages_per_rank, rank)
    tied = tied_across_ranks(model, stages.modules, placement)  # by identity: before 'fsdp' replaces any
    # 'fsdp' on meta: the parameters FSDP shards stay on meta until sharded, then each rank loads its 1/dp
    later = sharded_here(stages.modules, placement, local) if layout.data_parallel == "fsdp" else set()
    shards = local_weights(model, stages.modules, local, group, state_dict=state_dict, init_buffers=init_buffers,
                           device=where, later=later)
    for k in local:  # and the constants the stages' code reads
        for t in stage_tensors(stages[k]):
            move_in_place(t, where)
    also = [found_eval[2].modules] if found_eval is not None else []
    release_others(model, stages.modules, local, also)  # the other ranks' stages: no stale copy kept here
    evaluation = (eval_run(found_eval, model, flat, local, placement, chunks, pipe_group, where, CheckpointedStage)
                  if found_eval is not None else None)
    reading = ((lambda: LossFnReading(loss_fn, out_dims_of(checked.batching.merges), captured.unflatten_output))
               if loss_fn is not None else None)
    step_loss = StepLoss(loss_fn, reading, (), checked.batching, chunks, where,
                         replicated=layout.replicas is not None, graph=captured.graph_module.graph)

    metas_at = ShapeMetas(stages.modules, stages.input_names, where)

    def make_run(micro_flat: Sequence[Any]) -> TrainRun:
        """This rank's torch stages and schedules for one micro-batch shape (._shape_runs)."""
        metas = metas_at(micro_flat)
        pipe_stages, runners = stage_runners(stages, metas, flat, local, captured.out_spec, where, pipe_group,
                                             CheckpointedStage, checkpoint_stop=checkpoint_stop(checkpoint, chunks, True),
                                             training_of=model, clone_outputs=SCHEDULES[schedule].split_backward)
        output = runners.get(n_stages - 1)  # this rank's last stage, if it holds it

        def scaled_loss(tensors: Any, target: torch.Tensor) -> torch.Tensor:
            # the model's outputs as the model returns them, weighted as the loss counts; scale_grads=False
            return step_loss(lambda: output.flat(tensors), lambda: output.structured(tensors),  # type: ignore
                             target)

        train, forward_only = make_schedules(schedule, pipe_stages, chunks, scaled_loss, placement)
        return TrainRun(train, forward_only, output, metas[n_stages - 1].outputs, pipe_stages)

    runs: ShapeRuns[TrainRun] = ShapeRuns(make_run)
    runs.get(micro)  # the sample's shape, made at the build: a shape the stages cannot take fails here
    if layout.data_parallel == "fsdp":  # after the fake metadata run, which reads the whole parameters
        shard_stages(model, stages.modules, placement, local, layout.replicas, where)
        shards.load(model, group, where)
        if evaluation is not None:  # its stages would read the sharded parameters without gathering them
            evaluation, no_eval = None, "data_parallel='fsdp' shards the parameters the eval-mode stages would read"
    if compile_options is not None:  # after the fake metadata runs, which must see the plain stages
        compile_stages([stages[k] for k in local], compile_options)
        if evaluation is not None:
            compile_stages([evaluation.variant.stages[k] for k in local], compile_options)
    ties = TiedGradients(model, tied, layout.rows, wait)
    warn_same_draws(captured.graph_module, pipe_group, where)  # dropout masks repeated stage by stage
    guard_eager(model)  # model(x) on this rank alone: refused by name while it is not whole
    return DistributedPipeline(model, captured, agreed, stages, placement, runs, layout, chunks, ties,
                               list(ties.groups.values()), device=where, step_loss=step_loss,
                               mode_sensitive=checked.prepared.mode_sensitive, batching=checked.batching,
                               evaluation=evaluation, no_eval=no_eval)
