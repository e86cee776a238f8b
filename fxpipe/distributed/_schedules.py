"""The schedules ``fxpipe.distributed`` runs, and where each puts its stages: one place for both.

A torch.distributed.pipelining schedule fixes which rank runs which stage. The looped
schedules (GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble) put stage ``k`` on
rank ``k % world``; ZB-V puts the stages in a V: rank ``r`` holds stages ``r`` and
``2 * world - 1 - r``, so the first and the last stage share rank 0 and the middle two share the
last rank. Everything that depends on placement -- which stages a rank builds, which ranks a
tied parameter's gradient is summed over, which rank holds the last stage -- reads
:func:`rank_of_stage`, and :func:`make_schedules` checks that torch's schedule agrees with it.

The zero-bubble schedules split each backward into an input-gradient pass (B) and a
weight-gradient pass (W) run later; between the two torch ``detach_()``-es the stage's outputs,
so those schedules need the stage outputs cloned (:class:`fxpipe.distributed._values.StageRunner`)
and the split made exact for every parameter (:mod:`fxpipe.distributed._split_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from fxpipe.errors import ArgumentError, DistributedError

__all__ = ["Schedule", "SCHEDULES", "rank_of_stage", "stages_of_rank", "rounds", "check_schedule", "make_schedules",
           "forward_schedule",
           "PlacedLoopedBFS"]


@dataclass(frozen=True)
class Schedule:
    """One schedule name: the torch classes that run it and how it places the stages."""

    name: str
    #: torch schedule class for one stage per rank, and for several (None: not offered)
    one: Optional[type]
    several: Optional[type]
    #: 'loop' (stage k on rank k % world) or 'v' (rank r: stages r and 2 * world - 1 - r, ...)
    placement: str = "loop"
    #: backward split into input- and weight-gradient passes (zero bubble)
    split_backward: bool = False
    #: the only number of stages per rank it runs (None: any it has a class for)
    exactly: Optional[int] = None

    def torch_class(self, stages_per_rank: int) -> Optional[type]:
        return self.one if stages_per_rank == 1 else self.several


SCHEDULES: dict[str, Schedule] = {s.name: s for s in [
    Schedule("gpipe", ScheduleGPipe, ScheduleLoopedBFS),
    Schedule("1f1b", Schedule1F1B, None),
    Schedule("interleaved1f1b", None, ScheduleInterleaved1F1B),
    Schedule("interleavedzb", None, ScheduleInterleavedZeroBubble, split_backward=True),
    Schedule("zbv", None, ScheduleZBVZeroBubble, placement="v", split_backward=True, exactly=2),
]}


def rank_of_stage(schedule: str, world: int, stages_per_rank: int) -> list[int]:
    """The rank of each of the ``world * stages_per_rank`` stages under ``schedule``."""
    n = world * stages_per_rank
    if SCHEDULES[schedule].placement == "loop":
        return [k % world for k in range(n)]
    # V: each block of ``world`` consecutive stages goes down the ranks, the next one back up
    return [k % world if (k // world) % 2 == 0 else world - 1 - k % world for k in range(n)]


def stages_of_rank(schedule: str, world: int, stages_per_rank: int, rank: int) -> list[int]:
    """The stages ``rank`` runs under ``schedule``, in increasing order."""
    return [k for k, r in enumerate(rank_of_stage(schedule, world, stages_per_rank)) if r == rank]


#: the schedules whose torch class runs the micro-batches in rounds (see :func:`rounds`)
_IN_ROUNDS = ("interleaved1f1b", "interleavedzb")


def rounds(chunks: int, world: int) -> int:
    """The rounds torch's interleaved schedules split ``chunks`` micro-batches into
    (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``): ``chunks`` must be a
    multiple of it."""
    return max(1, chunks // world)


def _interleaved_chunks(chunks: int, world: int) -> list[int]:
    """The nearest numbers of micro-batches below and above ``chunks`` the interleaved schedules run."""
    fits = [c for c in range(1, 2 * chunks + world) if c % rounds(c, world) == 0]
    below = [c for c in fits if c < chunks][-1:]
    above = [c for c in fits if c > chunks][:1]
    return below + above


def check_schedule(schedule: str, stages_per_rank: int, chunks: int, world: int) -> None:
    """:class:`~fxpipe.errors.ArgumentError` naming the argument for a schedule that cannot run
    this layout, by torch's own rules (torch.distributed.pipelining.schedules, 2.13):
    ``1f1b`` (``Schedule1F1B``) needs ``chunks >= world_size``; the interleaved schedules need
    ``chunks`` to be a multiple of their number of rounds, ``max(1, chunks // world_size)``;
    gpipe (GPipe, LoopedBFS) and zbv run any number (zbv with fewer micro-batches than stages
    drops the actions of the missing ones; exact, tested)."""
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}",
                            argument="schedule")
    if not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool) or stages_per_rank < 1:
        raise ArgumentError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}",
                            argument="stages_per_rank")
    chosen = SCHEDULES[schedule]
    if chosen.exactly is not None and stages_per_rank != chosen.exactly:
        raise ArgumentError(f"schedule {schedule!r} runs exactly {chosen.exactly} stages per rank (a V: rank r "
                            f"holds stages r and 2 * world_size - 1 - r); got stages_per_rank={stages_per_rank}",
                            argument="stages_per_rank")
    if chosen.torch_class(stages_per_rank) is None:
        which = "one stage per rank" if stages_per_rank == 1 else "several stages per rank"
        fits = [s.name for s in SCHEDULES.values()
                if s.torch_class(stages_per_rank) is not None and s.exactly in (None, stages_per_rank)]
        raise ArgumentError(f"schedule {schedule!r} does not run {which} (stages_per_rank={stages_per_rank}); "
                            f"use one of {fits}", argument="schedule")
    if schedule == "1f1b" and chunks < world:
        raise ArgumentError(f"schedule '1f1b' needs chunks >= the number of stages ({world}), as torch's "
                            f"Schedule1F1B does; got chunks={chunks}: raise chunks, or use schedule='gpipe'",
                            argument="chunks")
    if schedule in _IN_ROUNDS and chunks % rounds(chunks, world):
        raise ArgumentError(
            f"schedule {schedule!r} runs the micro-batches in rounds of about world_size ({world}) and needs chunks "
            f"to be a multiple of its number of rounds, max(1, chunks // world_size) = {rounds(chunks, world)}, as "
            f"torch's interleaved schedules do; got chunks={chunks}: use chunks="
            f"{' or '.join(map(str, _interleaved_chunks(chunks, world)))}, or schedule='gpipe' or 'zbv'",
            argument="chunks")


class _Unmerged:
    """A forward-only schedule that returns the last stage's output of each micro-batch, for
    fxpipe to merge as one process does (a 0-dim loss weighed by its counted labels): torch's
    merge concatenates every output along dim 0 and fails on a loss."""

    def _merge_outputs(self, output_chunks: list[Any]) -> Any:
        return list(output_chunks)


class ForwardGPipe(_Unmerged, ScheduleGPipe):
    """``ScheduleGPipe``, its outputs per micro-batch (``eval_step``, one stage per rank)."""


#: what a forward-only schedule must not run: backwards and their gradients' transfers (its
#: REDUCE_GRAD stays: under 'fsdp' it puts the stage's parameters back to their shards, which a
#: forward-only step without it left unsharded in the model)
_BACKWARD_ACTIONS = frozenset(t for t in (getattr(_ComputationType, n, None) for n in (
    "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_B", "RECV_B")) if t is not None)


class PlacedLoopedBFS(_Unmerged, ScheduleLoopedBFS):
    """torch's LoopedBFS forward order (each rank runs all micro-batches of its stages in
    increasing stage order), forward only, for any placement: ``eval_step`` runs under it.

    torch's V schedule cannot run forward only, nor can LoopedBFS on a V placement (a
    backward action between two stages of one rank asks for their gradient even without
    backward), and LoopedBFS assumes the looped placement. torch infers the stage-to-rank map
    from the actions, so placing the actions places the stages; it also requires a backward
    per forward, so they are there, and dropped from what runs."""

    def __init__(self, stages: Sequence[Any], n_microbatches: int, placement: Sequence[int]) -> None:
        self._placement = list(placement)
        super().__init__(list(stages), n_microbatches, scale_grads=False)

    def _prepare_schedule_with_comms(self, actions: Any, format: str = "compute_only") -> None:
        # torch lowers the placed backwards into gradient sends and receives; run, a receive posted
        # and never consumed by a backward made the next eval_step of that shape fail ("Recv twice
        # ... without executing backward", a trial). Forward only: every backward action dropped.
        super()._prepare_schedule_with_comms(actions, format=format)
        self.pipeline_order_with_comms = {
            rank: [a for a in order if a.computation_type not in _BACKWARD_ACTIONS]
            for rank, order in self.pipeline_order_with_comms.items()}

    def _calculate_single_rank_operations(self, rank: int) -> list[Optional[_Action]]:
        mine = [k for k, r in enumerate(self._placement) if r == rank]
        ops: list[Optional[_Action]] = [None] * rank
        for k in mine:
            ops.extend(_Action(k, _ComputationType.FORWARD, mb) for mb in range(self._n_microbatches))
        ops.extend([None] * (2 * (self.pp_group_size - 1 - rank)))  # torch checks a schedule has backwards
        for k in reversed(mine):
            ops.extend(_Action(k, _ComputationType.FULL_BACKWARD, mb) for mb in reversed(range(self._n_microbatches)))
        return ops


def forward_schedule(stages: Sequence[Any], chunks: int, placement: Sequence[int]) -> Any:
    """The forward-only schedule ``eval_step`` runs over this rank's ``stages`` (see
    :func:`make_schedules`): on the last stage's rank, ``step()`` returns each micro-batch's
    output, unmerged."""
    if len(stages) == 1:
        return ForwardGPipe(stages[0], chunks, scale_grads=False)
    return PlacedLoopedBFS(stages, chunks, placement)


def make_schedules(schedule: str, stages: Sequence[Any], chunks: int, loss_fn: Callable[..., Any],
                   placement: Sequence[int]) -> tuple[Any, Any]:
    """(the training schedule, a forward-only schedule) over this rank's ``stages``.

    torch's ``schedule.eval()`` still computes the loss (and needs a target), so ``eval_step``
    runs the same stages under a schedule without ``loss_fn``: GPipe for one stage per rank,
    else LoopedBFS's order over this placement (:class:`PlacedLoopedBFS`).
    Each schedule sets the stages' stage-to-rank map; both must agree with ``placement``.
    """
    chosen = SCHEDULES[schedule]
    cls = chosen.torch_class(len(stages))
    forward = forward_schedule(stages, chunks, placement)
    if len(stages) == 1:
        training = cls(stages[0], chunks, loss_fn=loss_fn, scale_grads=False)
    else:
        training = cls(list(stages), chunks, loss_fn=loss_fn, scale_grads=False)  # last: its map stays on the stages
    for s in (training, forward):
        mapping = getattr(s, "stage_index_to_group_rank", None)
        if mapping is not None and [mapping[k] for k in range(len(placement))] != list(placement):
            raise DistributedError(f"torch's {type(s).__name__} places the stages on ranks "
                                   f"{[mapping[k] for k in range(len(placement))]}, fxpipe on {list(placement)}: "
                                   f"this torch version places schedule {schedule!r} differently; use another schedule")
    return training, forward


def splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` (a torch schedule object) runs the weights' gradients in a pass of
    their own (the zero-bubble schedules), which covers the stages' parameters alone."""
    return any(isinstance(schedule, c) for s in SCHEDULES.values() if s.split_backward for c in (s.one, s.several) if c)
