"""``DistributedPipeline``: this rank's stages, driven by a torch.distributed.pipelining schedule.

Built by :func:`fxpipe.distributed.pipeline`. torch's ``PipelineStage`` and schedule do the
sending and the scheduling; this class adds what makes a step exact against eager and safe:

* the batch is checked on every rank before anything is sent: its tensors share a batch
  size that ``chunks`` divides (:class:`BatchShapeError`), and every rank has the same batch
  (its fingerprint, :mod:`._failures`); a batch refused on one rank is refused on every rank,
  which names it. Any length and any such batch size run: torch's stages, whose buffers
  are made for one shape, are made per micro-batch shape and cached (:mod:`._shape_runs`);
* an error in the middle of a step on one rank (in ``loss_fn``, in a stage) is named by
  every rank (:class:`~fxpipe.errors.PeerFailedError`, through the store, :mod:`._failures`);
* each micro-batch's loss is scaled by its weight in the whole batch's loss, read from
  ``loss_fn`` (a sum: 1; a mean: what it counts, samples, labels after its own shift, a mask's
  sum, class weights; :mod:`._loss`), and the schedule runs with ``scale_grads=False`` (torch's
  ``scale_grads`` divides the whole accumulated ``.grad``, wrong under gradient accumulation),
  so ``step`` gives eager's loss and gradients; a loss that cannot be split is refused before
  anything is sent;
* tied parameters used on several ranks have their gradients summed (:mod:`._ties`);
* with data-parallel replicas (``mesh=``), the loss is weighed over the global batch and the
  step's gradients are summed over the replicas once per step (:mod:`._replicas`); replicas
  given the same batch are refused;
* ``step`` returns the mini-batch loss on every rank (broadcast from the last stage's rank;
  with replicas, the global batch's);
* a step after the model changed in a way the stages cannot see (a submodule or parameter
  replaced, a traced attribute set anew) is refused on every rank
  (:class:`~fxpipe.errors.ModelChangedError`, :mod:`fxpipe.capture._model_check`);
* a step under another autocast state than the build's is refused: the stages exchange
  buffers of the dtypes the build's fake run found (bf16 sent into a float32 buffer gave
  garbage, measured), so build and step under the same ``torch.autocast``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.capture._tracing import Capture
from fxpipe.checks._targets import split_target
from fxpipe.emit._stages import Stages
from fxpipe.errors import BatchShapeError, DistributedError, ModeError, PipelineClosedError, StepError
from fxpipe.capture._baked_dtypes import BakedDtypes
from fxpipe.capture._mode_flags import ModeFlags
from fxpipe.capture._model_check import ModelCheck
from fxpipe.plan._value import Plan
from fxpipe.runtime._orders import FreshGradients, refuse_parameter_hooks

from ._clip import clip_grad_norm_
from ._copies import replica_copies
from ._eval_mode import EvalRun
from ._eval_step import EvalStep
from ._failures import Failures
from ._flags import ModelFlags
from ._loss import StepLoss, refuse_parameters_read
from ._schedules import splits_backward
from ._mesh import Layout
from ._pipe_state import PipelineState
from ._replicas import ReplicaGradients
from ._sharding import is_sharded
from ._shape_runs import ShapeRuns, TrainRun, micro_batch
from ._ties import TiedGradients

__all__ = ["DistributedPipeline"]



def _autocast(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for the stages' device type, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _autocast_text(dtype: Optional[torch.dtype], device_type: str) -> str:
    return "no autocast" if dtype is None else f"torch.autocast({device_type!r}, dtype={dtype})"


class DistributedPipeline(EvalStep, PipelineState):
    """The part of a pipeline this rank runs; every rank calls :meth:`step` together.

    Attributes:
        plan: the Plan every rank agreed on (the one made or loaded on rank 0).
        stages: all emitted stages (every rank emits all of them to check they agree);
            ``local`` are the indices this rank runs.
        placement: the rank of each stage, as the schedule places them
            (:func:`fxpipe.distributed._schedules.rank_of_stage`).
        rank, world_size: this process in the pipeline's process group.
        dp_rank, dp_size: this rank's replica and the number of replicas (``mesh=``; 0 and 1
            without data parallel), e.g. for ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)``.
        device: where this rank's stages run (a GPU over NCCL, the CPU over gloo).
    """

    def __init__(self, model: nn.Module, captured: Capture, plan: Plan, stages: Stages, placement: Sequence[int],
                 runs: ShapeRuns[TrainRun], layout: Layout, chunks: int,
                 ties: TiedGradients, groups: list[dist.ProcessGroup], device: torch.device = torch.device("cpu"),
                 step_loss: Optional[StepLoss] = None, mode_sensitive: str = "", batching: Any = None,
                 evaluation: Optional[EvalRun] = None, no_eval: str = "") -> None:
        self.module = model
        self.device = device
        self.capture = captured
        self.plan = plan
        self.stages = stages
        self.placement = list(placement)
        self.chunks = chunks
        group = layout.pipe
        self.rank = dist.get_rank(group)
        self.local = [k for k, r in enumerate(self.placement) if r == self.rank]
        self.world_size = dist.get_world_size(group)
        self.layout = layout
        self._runs = runs  # torch's stages and schedules per micro-batch shape (._shape_runs)
        self._run: Optional[TrainRun] = runs.latest  # the run used last
        self._batch = 0  # the latest step's batch size
        self._group = group
        self._last_rank = dist.get_global_rank(group, self.placement[-1])  # of the last stage
        self._ties = ties
        # what each replica holds whole ('ddp': everything; 'fsdp': buffers, a weight two local stages share)
        whole = [(n, t) for n, t in self._held() if not is_sharded(t)]
        # compared at each call (fxpipe.distributed._copies): tied parameters, and the replicas' copies
        self._copies = ties.copies(layout.world) + replica_copies(
            whole, layout.rows, layout.rows[layout.replica].index(dist.get_rank()), layout.world, layout.replicas)
        # the step's gradients of those summed over the replicas, once (._replicas); FSDP reduce-scatters the shards
        self._replicas = ReplicaGradients([t for _, t in whole if isinstance(t, nn.Parameter)], layout.replicas)
        self._groups = [*layout.groups, *groups]
        self._closed = False
        self._broken: Optional[str] = None  # the error that stopped a step midway (peers then gone or waiting)
        # one rank's error named by every rank of every replica
        self._failures = Failures(layout.world, device, layout.rows if layout.dp > 1 else None)
        self._failures.watch()  # and an uncaught error between steps too
        self._step_loss = step_loss  # loss_fn per micro-batch, weighted as it counts (._loss)
        self._batching = batching  # how outputs merge (step(return_outputs=True))
        self._autocast = _autocast(device.type)  # the state pipeline() ran the fake metadata run under
        # what the stages hold from the model (all of them: every rank refuses the same change)
        self._model_check = ModelCheck(model, captured.graph_module, captured.reads, stages.modules)
        self._flags = ModelFlags(model)
        # the modes the graph baked in (torch.export: every traced module's): followed or refused
        self._captured_training = model.training
        self._mode_sensitive = mode_sensitive
        self._mode_flags = ModeFlags(model, mode_sensitive)
        self._dtypes = BakedDtypes(model, captured.graph_module, captured.method)
        #: eval_step in eval mode for a graph built in training mode (fxpipe.distributed._eval_mode),
        #: or why the build could not capture it
        self._evaluation, self._no_eval = evaluation, no_eval

    @property
    def n_stages(self) -> int:
        return self.plan.n_stages

    @property
    def schedule(self) -> Any:
        """The torch.distributed.pipelining schedule :meth:`step` ran last (the build's sample's
        shape before any step; read by :mod:`.trace`)."""
        return self._run.schedule if self._run is not None else None

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the pipeline's ranks."""
        return self._group

    def stage_code(self, k: int) -> str:
        """Readable code of stage ``k`` (any stage, local or not), with source-line comments."""
        return self.stages.stage_code(k)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every rank's
        gradients (a tied parameter counted once), and the same scale on every rank, so tied
        copies stay equal. Call it on every rank, between ``step`` and the optimizer's step;
        returns the total norm (0-dim) on every rank (:mod:`._clip`). Called on some ranks only
        (``if rank == 0:``), every rank refuses it before anything is summed: gloo aborted the
        process on the mismatched collectives (a trial)."""
        self._check_open()
        self.agree_on_call("clip_grad_norm_()", "clip its gradients")
        with self._failures.reported():
            # 'fsdp': each replica holds a shard of most gradients, so the norm sums over every rank, and a
            # gradient every replica holds whole (a weight two local stages share) counts on the first replica
            fsdp = self.layout.data_parallel == "fsdp"
            group = self.layout.world if fsdp else self._group

            def counted(p: nn.Parameter) -> bool:
                return self._ties.counted_here(p) and (not fsdp or is_sharded(p) or self.layout.replica == 0)

            return clip_grad_norm_(list(self.parameters()), counted, max_norm, norm_type, group, self.device,
                                   error_if_nonfinite)

    def agree_on_call(self, call: str, doing: str) -> None:
        """Every rank is in ``call`` (one of the calls ``Failures`` knows), or every rank refuses
        it naming each rank's call: the agreement ``step`` and ``eval_step`` begin with, whose
        all-reduce has the same size for every call, so mismatched calls meet in it."""
        with self._failures.agreed(doing, call=call) as agreement:
            agreement.copies = self._copies  # the agreement's size: as in step()

    # -- running -------------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict, run: Optional[EvalRun] = None) -> tuple[list[Any], list[Any]]:
        """The flat inputs of a call and one micro-batch of them, checked against the capture
        (structure, the sizes it fixed, its shape guards) and for a batch size ``chunks``
        divides, after checking that the model did not change since the build
        (:mod:`fxpipe.capture._model_check`). ``run``: the eval capture ``eval_step`` runs in
        eval mode (:mod:`._eval_mode`), None for the build's."""
        self._refuse_released()
        if run is not None:
            run.variant.model_check.check()
            run.variant.dtypes.check()
        else:
            self._model_check.check()
            if self._mode_sensitive and self.module.training != self._captured_training:
                built, now = ("training", "eval") if self._captured_training else ("eval", "training")
                extra = ""
                if now == "eval":  # eval_step runs the build's eval capture where there is one
                    extra = (" eval_step() runs in eval mode (every module in eval) with the eval-mode capture the "
                             "build made" + (f"; this build could not make it ({self._no_eval})" if self._no_eval
                                             else "; step() trains in training mode only") + ".")
                raise ModeError(
                    f"the model is in {now} mode, but this pipeline was built in {built} mode and its stages have that "
                    f"mode baked in ({self._mode_sensitive}): dropout and BatchNorm would silently run as in {built} "
                    f"mode.{extra} Switch the model back (model.{'train' if self._captured_training else 'eval'}()) "
                    f"or build a pipeline in {now} mode for this use.")
            self._mode_flags.check()
            self._dtypes.check()
        kind = self.device.type
        if _autocast(kind) != self._autocast:
            raise DistributedError(
                f"this call runs under {_autocast_text(_autocast(kind), kind)}, but the pipeline was built under "
                f"{_autocast_text(self._autocast, kind)}: its stages exchange buffers of the dtypes found at build. "
                "Build the pipeline under the same torch.autocast context as you call step()/eval_step() in.")
        capture = run.variant.capture if run is not None else self.capture
        flat = capture.flatten_inputs(args, kwargs)  # names what differs
        capture.check_context(self.module, args, kwargs, flat, self.device)  # grad mode, dtypes the code read
        micro = micro_batch(flat, self.chunks)
        capture.check_micro_batches(args, kwargs, [micro])  # export's guards on the batch's size
        return flat, micro

    def _sent(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What this rank feeds its schedule: the inputs on its device when it runs the first
        stage (given on the CPU, they are copied there), nothing otherwise."""
        if 0 not in self.local:
            return ()
        return tuple(t.to(self.device, non_blocking=True) for t in tensors)

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError("this fxpipe.distributed pipeline was closed; build a new one")
        if self._broken is None and self._failures.lost is not None:
            self._broken = self._failures.lost
        if self._broken is not None:
            raise PipelineClosedError(
                f"an earlier step of this pipeline stopped while the ranks were exchanging values ({self._broken}): "
                "the other ranks stopped or wait at another point of the schedule, so no further step can be "
                "exact. Build a new pipeline (in a new job if a rank ended)")

    @contextmanager
    def _exchanging(self) -> Iterator[None]:
        """The schedule's run: an error names the failing rank on every rank
        (:meth:`Failures.reported`), and leaves the pipeline refusing further steps."""
        try:
            with self._failures.reported():
                yield
        except BaseException as e:
            first = str(e).splitlines()[0] if str(e) else ""
            self._broken = f"{type(e).__name__}: {first[:300]}"
            raise

    def step(self, *args: Any, target: Any = None, return_outputs: Any = False, **kwargs: Any) -> Any:
        """One training step of the mini-batch ``args``/``kwargs`` against ``target`` (a
        tensor, or a tuple or dict of tensors, each split along dim 0; none for the model's
        own loss, ``loss_fn=None``), on every rank at once. Returns the mini-batch loss (a
        0-dim tensor, no grad) on every rank, and adds this step's gradients to the ``.grad``
        of this rank's parameters. ``return_outputs``: as for :meth:`fxpipe.Pipeline.step`,
        ``(loss, outputs)`` with the outputs on the last stage's rank, ``None`` on the others."""
        self._check_open()
        own = self._step_loss is not None and self._step_loss.own is not None
        kept_weights: Optional[dict] = None  # return_outputs=True: the counts the outputs merge by
        with self._failures.agreed("check its batch", call="step()") as agreement:  # refused on one: on all
            if not torch.is_grad_enabled():  # torch's schedule raises once the step began: pipeline lost
                raise StepError("step() is called under torch.no_grad() or torch.inference_mode() (a validation "
                                "block left open?), and a training step needs gradients. Nothing was sent. What to do: "
                                "call step() outside that block, or eval_step() for a forward without gradients")
            if not (return_outputs is False or return_outputs is True or callable(return_outputs)):
                raise TypeError(f"return_outputs must be False, True or a callable taking one micro-batch's output, "
                                f"got {type(return_outputs).__name__}")
            agreement.copies = self._copies  # tied parameters: equal on the ranks holding them
            agreement.flags = self._flags.fingerprints()  # modes and frozen weights: alike on every rank
            self._flags.refuse_unfrozen()
            refuse_parameter_hooks(self.named_parameters(), "every torch.distributed.pipelining schedule", gpipe=False)
            flat, micro = self._inputs(args, kwargs)
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            agreement.batch = (tensors, target)  # every rank must have this step's batch, of one shape
            batch = tensors[0].shape[0] if tensors else self.chunks
            run = self._runs.get(micro)  # torch's stages for this shape (made on its first step)
            targets = None
            if own and target is not None:
                raise BatchShapeError("target= is given, but this pipeline trains the model's own loss (built with "
                                      "loss_fn=None): leave target out, or build with loss_fn=")
            if not own:
                if not isinstance(target, (torch.Tensor, tuple, list, dict)) or (
                        isinstance(target, torch.Tensor) and (target.dim() == 0 or target.shape[0] != batch)):
                    got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
                    raise BatchShapeError(f"target must be a tensor with the batch's {batch} samples along dim 0, or "
                                          f"a tuple or dict of such tensors (split into {self.chunks} micro-batches), "
                                          f"got {got}")
                targets = split_target(target, [batch // self.chunks] * self.chunks)
            last = self.n_stages - 1 in self.local
            if last and self._step_loss is not None:  # the loss weighed before anything is sent
                self._step_loss.outputs = list(run.outputs)  # one micro-batch's, of this shape
                # a parameter of the loss's own is the caller's, unless replicas each train theirs or the
                # schedule's weight pass (zero bubble) covers the stages' parameters alone
                alone = self.layout.replicas is not None or splits_backward(run.schedule)
                self._step_loss.refuse_read = lambda read: refuse_parameters_read(
                    read, list(self.named_parameters()), self.module, self.layout.data_parallel == "fsdp", alone)
                self._step_loss.begin(targets, flat)
                self._step_loss.keep = return_outputs
                if return_outputs is True:  # merged as eval_step merges: a counted loss by its counts
                    kept_weights = self._step_loss.merge_weights
                    if kept_weights is None:  # a loss_fn step: the outputs' own counts, read here
                        kept_weights = self._batching.weights(flat, self._batching.split(flat, self.chunks)[0])
                if self.layout.replicas is not None:  # the replicas' further counts, and samples, must agree
                    agreement.ratios = self._step_loss.ratios
                    agreement.shape = self._step_loss.shape
        # torch's schedules split a target tensor and hand each micro-batch's to the loss, which
        # takes the real one from StepLoss: a stand-in, split alike
        stand_in = torch.zeros(batch, device=self.device) if last else None
        losses: list[torch.Tensor] = []
        self._run, self._batch = run, batch
        replicas = self.layout.replicas
        grads = FreshGradients(self.parameters())  # put back on failure where every .grad was None
        self._replicas.before_step()
        self._ties.before_step()
        with self._exchanging():
            try:
                if last and replicas is not None and self._step_loss is not None:
                    self._step_loss.over_replicas(replicas)  # each micro-batch's share of the global batch
                sent, upstream = _from_leaves(self._sent(tensors))
                run.schedule.step(*sent, target=stand_in, losses=losses if last else None, return_outputs=False)
                _backward_upstream(upstream)
            except BaseException:
                self._ties.restore()
                self._replicas.restore()
                grads.drop()  # micro-batches whose backward ran left part of the step in .grad; eager leaves none
                raise
            self._ties.after_step()
            self._replicas.after_step()
            if last and self._step_loss is not None:
                self._step_loss.copies.forget()  # the target alike on every rank (the others ran no loss_fn)
            loss = self._broadcast_loss(torch.stack([x.detach() for x in losses]).sum() if last else None)
            if replicas is not None:  # each replica's part of the global batch's loss, summed
                total = loss.detach().to(torch.float64).reshape(1)
                dist.all_reduce(total, group=replicas)
                loss = total[0].to(loss.dtype)
        if return_outputs is False:
            return loss
        return loss, self._kept_outputs(return_outputs, kept_weights) if last else None

    def _kept_outputs(self, how: Any, weights: Optional[dict]) -> Any:
        """The outputs ``step(return_outputs=...)`` kept on the last stage's rank: merged along
        dim 0 as ``eval_step`` merges them (``True``), or the callable's result per micro-batch."""
        assert self._step_loss is not None
        kept, self._step_loss.kept = self._step_loss.kept, []
        if how is not True:
            return kept
        sizes = [self._batch // self.chunks] * self.chunks if self._batch else [1] * len(kept)
        return self.capture.unflatten_output(self._batching.merge(kept, sizes, weights))

    def close(self) -> None:
        """Releases the pipeline's process groups (the default group stays the caller's)."""
        if self._closed:
            return
        self._closed = True
        self._failures.forget()
        self._runs.clear()
        self._run = None
        if self._evaluation is not None:
            self._evaluation.runs.clear()
        for g in self._groups:
            dist.destroy_process_group(g)
        self._groups = []

    def __enter__(self) -> "DistributedPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank={self.rank}/{self.world_size}, stages={self.local} of {self.n_stages}, "
                f"chunks={self.chunks})")


def _from_leaves(inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], list]:
    """The inputs as the schedule gets them: one computed with grad (a soft prompt, ``emb * 1.0``;
    an input copied to the device) as a leaf of its own, and the pairs (input, leaf). Why: each
    micro-batch is a piece of the input, and the first micro-batch's backward went on through the
    graph that made it and freed it, so the second's failed in torch ('backward through the graph
    a second time', a trial). :func:`_backward_upstream` takes the leaves' gradients through that
    graph once, as eager's one backward does."""
    upstream = []
    sent = []
    for t in inputs:
        if t.requires_grad and t.grad_fn is not None:
            leaf = t.detach().requires_grad_()
            upstream.append((t, leaf))
            t = leaf
        sent.append(t)
    return tuple(sent), upstream


def _backward_upstream(upstream: list) -> None:
    taken = [(t, leaf.grad) for t, leaf in upstream if leaf.grad is not None]
    if taken:
        torch.autograd.backward([t for t, _ in taken], [g for _, g in taken])
