"""``fxpipe.distributed.pipeline``: one automatic plan, run by one process per stage.

Every rank builds the same model and calls :func:`pipeline` with the same arguments. Each
captures and checks the model exactly as ``fxpipe.pipeline`` does (the same
:func:`fxpipe.api.checked_capture`); rank 0 alone plans and broadcasts the plan
(:mod:`.agree`); every rank carries the plan's portals through the stages in between
(:mod:`.carry`), emits all stages, checks their code against the other ranks', finds the
static boundary metadata with one fake run (:mod:`.meta`) and wraps its own stages in
torch.distributed.pipelining ``PipelineStage``s under a torch schedule.
"""

from __future__ import annotations

from datetime import timedelta
import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)

from fxpipe.api import check_plan, check_split_points, checked_capture
from fxpipe.emit import Stages, emit_stages
from fxpipe.errors import BatchShapeError, DistributedError
from fxpipe.frontend import CHECKPOINT_MODES, check_chunks, checkpoint_stop
from fxpipe.mutation import check_kept_together
from fxpipe.plan import Plan
from fxpipe.planning import BALANCE_BY, make_plan
from fxpipe.prepare import preserved

from .agree import agree_on_stages, broadcast_plan
from .carry import carried_plan
from .materialise import InitBuffers, capture_sample, local_weights
from .meta import stage_metas
from .pipe import DistributedPipeline
from .sources import StateDictSource
from .ties import TiedGradients
from .values import StageRunner

__all__ = ["pipeline", "SCHEDULES", "DEFAULT_TIMEOUT"]

#: schedule name -> (torch schedule class for one stage per rank, for several)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, ScheduleLoopedBFS),
    "1f1b": (Schedule1F1B, None),
    "interleaved1f1b": (None, ScheduleInterleaved1F1B),
}

#: seconds a rank waits for its peers in any collective or transfer of the pipeline
DEFAULT_TIMEOUT = 300.0


class CheckpointedStage(PipelineStage):
    """A ``PipelineStage`` that tells its :class:`StageRunner` which micro-batch it runs
    (torch's schedules pass the micro-batch index as ``fwd_chunk_id``), so the runner can
    checkpoint the chosen ones."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.micro_batch = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


def _check_args(model: nn.Module, chunks: int, loss_fn: Any, schedule: str, stages_per_rank: int,
                balance_by: str, timeout: float, checkpoint: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("fxpipe.distributed.pipeline needs torch.distributed initialised on every rank: call "
                               "torch.distributed.init_process_group('gloo') first (torchrun sets the environment)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_chunks(chunks)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    if SCHEDULES[schedule][0 if stages_per_rank == 1 else 1] is None:
        which = "one stage per rank" if stages_per_rank == 1 else "several stages per rank"
        fits = [s for s, c in SCHEDULES.items() if c[0 if stages_per_rank == 1 else 1] is not None]
        raise ValueError(f"schedule {schedule!r} does not run {which} (stages_per_rank={stages_per_rank}); "
                         f"use one of {fits}")
    world = dist.get_world_size()
    if schedule != "gpipe" and chunks < world * stages_per_rank:
        raise ValueError(f"schedule {schedule!r} needs chunks >= the number of stages ({world * stages_per_rank}); "
                         f"got chunks={chunks}: raise chunks, or use schedule='gpipe'")
    if balance_by not in BALANCE_BY:
        raise ValueError(f"balance_by must be one of {', '.join(map(repr, BALANCE_BY))}, got {balance_by!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {checkpoint!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _micro_batch(flat: Sequence[Any], chunks: int) -> list[Any]:
    """The sample's flat inputs cut to one micro-batch; refuses a batch ``chunks`` does not divide."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    sizes = {x.shape[0] if x.dim() else None for x in tensors}
    if len(sizes) != 1 or None in sizes or next(iter(sizes)) % chunks:
        shapes = [tuple(x.shape) for x in tensors]
        raise BatchShapeError(f"every tensor input must have the same batch size along dim 0, a multiple of "
                              f"chunks={chunks} (micro-batches of equal size keep a mean loss exact); the sample's "
                              f"tensor inputs have shapes {shapes}")
    size = next(iter(sizes)) // chunks
    return [x[:size] if isinstance(x, torch.Tensor) else x for x in flat]


def pipeline(
    model: nn.Module,
    sample: Any,
    *,
    chunks: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
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
) -> DistributedPipeline:
    """This rank's part of ``model`` run as a pipeline of ``world_size * stages_per_rank`` stages.

    Call it on every rank of an initialised default process group (gloo, CPU), with the
    same model (same class, config and seed) and the same arguments. Rank 0's parameters
    and buffers are broadcast to every rank first, as DDP does; or, with ``state_dict=``,
    each rank loads only its own stages' tensors -- the way to run a model built on the meta
    device, of which each rank then materialises only its own stages
    (:mod:`fxpipe.distributed.materialise`).

    Args:
        model, sample, sample_kwargs, leaf_modules, split_points: as for :func:`fxpipe.pipeline`.
        chunks: micro-batches per mini-batch; must divide the batch size.
        loss_fn: ``loss_fn(output, target)`` on one micro-batch, mean-reduced over its samples
            (then ``step`` gives eager's loss and gradients); ``output`` has the model's structure.
        schedule: ``'gpipe'`` or ``'1f1b'``; with ``stages_per_rank > 1``: ``'gpipe'``
            (torch's LoopedBFS) or ``'interleaved1f1b'``. Stage ``k`` runs on rank ``k % world_size``.
        plan: a saved plan (object or JSON path), read on rank 0; no profiling.
        balance_by: as for :func:`fxpipe.pipeline`; default ``'params'`` (deterministic).
        checkpoint: ``'except_last'`` (default), ``'always'`` or ``'never'``, as for
            :func:`fxpipe.pipeline`: each checkpointed micro-batch's stage forward keeps no
            activations and is recomputed in its backward (``torch.utils.checkpoint``,
            non-reentrant, RNG and autocast state restored: dropout masks match), on every stage.
        timeout: seconds any rank waits for its peers before the job fails (no hang).
        state_dict: the weights, read by each rank for its own stages only: a mapping, the path
            of a ``torch.save`` file (memory-mapped), the path of a ``torch.distributed.checkpoint``
            directory, or a callable ``keys -> mapping`` (:mod:`fxpipe.distributed.sources`).
            Needed for a model on the meta device (which is then planned by ``'params'`` or
            ``'memory'``, never timed).
        init_buffers: ``fn(name, module)`` recomputing a module's non-persistent buffers (in no
            checkpoint) after a meta model is materialised; default: a transformers model's own
            ``_init_weights``. A buffer left unwritten raises ``MaterialiseError``.

    Raises:
        fxpipe.errors.DistributedError: no process group, or rank 0 could not plan.
        fxpipe.errors.PlanMismatchError: the ranks' stage code differs.
        fxpipe.errors.BatchShapeError: the sample's batch is not a multiple of ``chunks``.
        fxpipe.errors.MetaDeviceError: a model on meta without ``state_dict=``, or with
            ``balance_by='time'``; a sample on meta.
        fxpipe.errors.MaterialiseError: a key of this rank's stages missing from ``state_dict``
            (or of another shape), a non-persistent buffer nothing restores.
        and every error :func:`fxpipe.pipeline` raises for the model.
    """
    _check_args(model, chunks, loss_fn, schedule, stages_per_rank, balance_by, timeout, checkpoint)
    check_split_points(split_points, plan)
    wait = timedelta(seconds=float(timeout))
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)), timeout=wait)
    n_stages = world * stages_per_rank
    args: tuple = sample if isinstance(sample, tuple) else (sample,)
    kwargs = dict(sample_kwargs or {})
    cap_args, cap_kwargs = capture_sample(model, args, kwargs, state_dict=state_dict, balance_by=balance_by,
                                          plan=plan)  # on meta for a meta model

    with preserved(model):
        prepared, batching = checked_capture(model, cap_args, cap_kwargs, leaf_modules, 0, None)
        batching.refuse_mode(True)  # step() trains: a failed training-mode check refuses the build
        captured = prepared.capture
        flat = captured.flatten_inputs(args, kwargs)
        micro = _micro_batch(captured.flatten_inputs(cap_args, cap_kwargs), chunks)

        def make() -> Plan:
            if plan is None:
                return make_plan(captured, cap_args, cap_kwargs, n_stages, balance_by=balance_by,
                                 split_points=split_points)
            chosen = plan if isinstance(plan, Plan) else Plan.load(plan)
            check_plan(chosen, captured, n_stages, None if isinstance(plan, Plan) else str(plan))
            return chosen

        agreed = broadcast_plan(make, group)
        built: list[Stages] = []

        def build() -> list[str]:
            check_plan(agreed, captured, n_stages)
            check_kept_together(captured.graph_module, agreed.assignment)
            gm = captured.graph_module
            built.append(emit_stages(gm, carried_plan(gm, agreed)))
            return [built[0].stage_code(k, source=False) for k in range(n_stages)]

        agree_on_stages(build, group)
    stages = built[0]
    with preserved(model):  # fake tensors still bump real counters (num_batches_tracked += 1)
        metas = stage_metas(stages.modules, micro, stages.input_names)

    rank = dist.get_rank(group)
    rank_of_stage = [k % world for k in range(n_stages)]
    local = [k for k in range(n_stages) if rank_of_stage[k] == rank]
    device = torch.device("cpu")
    local_weights(model, stages.modules, local, group, state_dict=state_dict, init_buffers=init_buffers,
                  exported=captured.method == "export", device=device)
    pipe_stages = []
    for k in local:
        first, last = k == 0, k == n_stages - 1
        inputs = [None if isinstance(v, torch.Tensor) else ("const", v) for v in flat] if first else metas[k].in_kinds
        runner = StageRunner(stages[k], inputs, None if last else metas[k].out_kinds, first, captured.out_spec,
                             checkpoint_stop=checkpoint_stop(checkpoint, chunks, True), training_of=model)
        pipe_stages.append(CheckpointedStage(runner, k, n_stages, device, input_args=metas[k].input_args,
                                         output_args=metas[k].output_args, group=group))

    def scaled_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / chunks  # mean over equal micro-batches; scale_grads=False

    single, multi = SCHEDULES[schedule]
    if stages_per_rank == 1:
        runner_schedule = single(pipe_stages[0], chunks, loss_fn=scaled_loss, scale_grads=False)
        forward_only = ScheduleGPipe(pipe_stages[0], chunks)
    else:
        runner_schedule = multi(pipe_stages, chunks, loss_fn=scaled_loss, scale_grads=False)
        forward_only = ScheduleLoopedBFS(pipe_stages, chunks)
    # torch's schedule.eval() still computes the loss (and needs a target): eval_step runs
    # the same stages under a schedule without loss_fn.
    ties = TiedGradients(model, stages.modules, rank_of_stage, group, wait)
    shapes = [tuple(x.shape) for x in flat if isinstance(x, torch.Tensor)]
    last_rank = dist.get_global_rank(group, rank_of_stage[-1])
    return DistributedPipeline(model, captured, agreed, stages, local, (runner_schedule, forward_only), group, last_rank, chunks,
                               shapes, ties, [group, *ties.groups.values()])
