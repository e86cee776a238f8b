"""Who runs what, in which order: the action list of each device under a schedule.

An action is ``(kind, stage, micro-batch)``: ``'F'`` forward, ``'B'`` full backward, ``'I'``
input-gradient pass and ``'W'`` weight-gradient pass (zero-bubble schedules). Two sources:

* :func:`single_process_order`: ``fxpipe.pipeline``'s runtime, one process. Forward in
  clock cycles (tick ``k`` runs every ``(i, j)`` with ``i + j = k``); backward in the exact
  reverse of that order (autograd runs the latest-created task first; with devices, Fork/Join
  enforces the same order). Stages on one device run their tasks one after another.
  :func:`single_process_1f1b`: the same runtime's 1F1B step, each micro-batch's backward
  between two forward ticks.
* :func:`torch_orders`: ``fxpipe.distributed``, one process per rank: the ``pipeline_order``
  torch's own schedule class builds for every rank (``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ...), read from the class itself, so a
  new torch version's order is the order simulated. The classes are built over stand-in
  stages that carry only what the order needs (counts and indices): no process group.
  The one exception is ``Schedule1F1B``: it does not run its ``pipeline_order`` (a drawing,
  which in torch 2.13 starts the last rank at micro-batch 1 and ends it at one that does not
  exist) but the loop of its ``_step_microbatches``: ``min(M, K - stage)`` forwards, then one
  backward and one forward in turn, then the remaining backwards (:func:`one_f_one_b`).

Both are checked against runs (``tests/tuning/test_orders_measured.py``): the order each
device ran its actions in, read from recorded spans by :func:`measured_orders`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from ..runtime._pipeline import clock_cycles

__all__ = ["Action", "single_process_order", "single_process_1f1b", "torch_orders", "DISTRIBUTED_SCHEDULES", "placement",
           "measured_orders"]

#: schedules of fxpipe.distributed the tuner knows, with their stages per rank
DISTRIBUTED_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "interleavedzb": 2, "zbv": 2}


class Action(NamedTuple):
    kind: str  # 'F', 'B', 'I' or 'W'
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def single_process_order(n_stages: int, chunks: int) -> List[Action]:
    """``fxpipe.pipeline``'s task order: forward clock cycles (the runtime's own), then their
    exact reverse."""
    forward = [Action("F", j, i) for tick in clock_cycles(chunks, n_stages) for i, j in tick]
    return forward + [Action("B", a.stage, a.mb) for a in reversed(forward)]


def single_process_1f1b(n_stages: int, chunks: int) -> Tuple[List[Action], Dict[Action, List[Action]]]:
    """``fxpipe.pipeline(schedule='1f1b')``'s order (:mod:`fxpipe.runtime._orders`): forward
    clock cycles; after the tick in which micro-batch ``i`` leaves the last stage, its backward
    through every stage, last first, on the caller's thread. Returns the order and the waits it
    adds: the caller waits for a tick before that backward, and for the backward before the
    next tick, so nothing of one overlaps the other (the simulation's ``after``)."""
    order: List[Action] = []
    after: Dict[Action, List[Action]] = {}
    previous: List[Action] = []  # what the next tick waits for: the last tick's backward
    for k, tick in enumerate(clock_cycles(chunks, n_stages)):
        forwards = [Action("F", j, i) for i, j in tick]
        for f in forwards:
            after[f] = list(previous)
        order += forwards
        done = k - (n_stages - 1)  # the micro-batch that left the last stage in this tick
        if 0 <= done < chunks:
            backward = [Action("B", j, done) for j in reversed(range(n_stages))]
            after[backward[0]] = forwards
            order += backward
            previous = [backward[-1]]
        else:
            previous = forwards
    return order, after


def placement(schedule: str, world: int, stages_per_rank: int) -> List[int]:
    """The rank of each stage, as ``fxpipe.distributed`` places them (imported when asked:
    torch.distributed.pipelining takes a while to import)."""
    from fxpipe.distributed._schedules import rank_of_stage

    return rank_of_stage(schedule, world, stages_per_rank)


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_orders(schedule: str, world: int, chunks: int) -> Dict[int, List[Action]]:
    """Each rank's compute actions under torch's class for ``schedule`` (no process group).

    Raises ``ValueError`` (the message of ``fxpipe.distributed.pipeline``'s refusal, or
    torch's) when ``fxpipe.distributed`` or the class refuses ``chunks`` for ``world``: an
    order is only predicted for what can be built.
    """
    from fxpipe.distributed._schedules import SCHEDULES, check_schedule
    from fxpipe.errors import ArgumentError

    spr = DISTRIBUTED_SCHEDULES[schedule]
    try:
        check_schedule(schedule, spr, chunks, world)
    except ArgumentError as e:
        raise ValueError(str(e)) from e
    cls = SCHEDULES[schedule].torch_class(spr)
    n = world * spr
    ranks = placement(schedule, world, spr)
    import torch

    def stand_in(k: int) -> SimpleNamespace:
        return SimpleNamespace(num_stages=n, group_size=world, group_rank=ranks[k], stage_index=k,
                               is_first=k == 0, is_last=k == n - 1, submod=torch.nn.Module(),
                               stage_index_to_group_rank={})

    if schedule == "1f1b":
        return {r: one_f_one_b(r, world, chunks) for r in range(world)}
    orders: Dict[int, List[Action]] = {}
    if spr == 1:
        built = cls(stand_in(0), chunks)
        table = built.pipeline_order
    else:
        built = cls([stand_in(k) for k in range(n) if ranks[k] == 0], chunks)
        table = built.pipeline_order
    for rank in range(world):
        actions: List[Action] = []
        for a in table.get(rank, []):
            if a is None:
                continue
            kind = _KINDS.get(getattr(a.computation_type, "name", str(a.computation_type)))
            if kind is not None:
                actions.append(Action(kind, int(a.stage_index), int(a.microbatch_index)))
        orders[rank] = actions
    return orders


def one_f_one_b(stage: int, n_stages: int, chunks: int) -> List[Action]:
    """What ``Schedule1F1B._step_microbatches`` runs on ``stage``: warm-up forwards, one
    backward and one forward in turn, the remaining backwards."""
    warmup = min(chunks, n_stages - stage)
    actions = [Action("F", stage, i) for i in range(warmup)]
    forward, backward = warmup, 0
    while True:
        actions.append(Action("B", stage, backward))
        backward += 1
        if forward == chunks:
            break
        actions.append(Action("F", stage, forward))
        forward += 1
    actions.extend(Action("B", stage, i) for i in range(backward, chunks))
    return actions


def check_complete(orders: Dict[int, Sequence[Action]], n_stages: int, chunks: int) -> None:
    """Every (stage, micro-batch) has one forward and one backward (B, or I and W)."""
    seen: Dict[tuple[int, int], str] = {}
    for actions in orders.values():
        for a in actions:
            seen[(a.stage, a.mb)] = seen.get((a.stage, a.mb), "") + a.kind
    for s in range(n_stages):
        for i in range(chunks):
            kinds = "".join(sorted(seen.get((s, i), "")))
            if kinds not in ("BF", "FIW"):
                raise AssertionError(f"stage {s} micro-batch {i} runs {kinds!r}")


#: span kinds of the two recorders -> action kinds ('backward' is 'I' where a 'weight' follows)
_SPAN_KINDS = {"forward": "F", "backward": "B", "weight": "W"}


def measured_orders(spans: Sequence[Any], step: int | None = None) -> Dict[Any, List[Action]]:
    """Each device's actions in the order they started, read from recorded spans: those of
    ``fxpipe.distributed.trace.record`` (by ``rank``; ``step``: one ``pipe.step`` of several)
    or of the single-process runtime's ``fxpipe.runtime._timeline.Recorder`` (by ``device``,
    every partition on one key when they share it). Only compute spans count (forward,
    backward, weight): a recomputation runs inside its backward, and copies, transfers and
    the loss are not actions. A backward whose (stage, micro-batch) also has a weight span is
    a zero-bubble input pass ``I``."""
    rows = []
    for s in spans:
        kind = _SPAN_KINDS.get(s.kind)
        if kind is None or (step is not None and getattr(s, "step", step) != step):
            continue
        stage = s.stage if hasattr(s, "stage") else s.partition
        rows.append((s.start, getattr(s, "rank", getattr(s, "device", 0)), kind, int(stage), int(s.microbatch)))
    weights = {(r[3], r[4]) for r in rows if r[2] == "W"}
    orders: Dict[Any, List[Action]] = {}
    for _, where, kind, stage, mb in sorted(rows, key=lambda r: r[0]):
        if kind == "B" and (stage, mb) in weights:
            kind = "I"
        orders.setdefault(where, []).append(Action(kind, stage, mb))
    return orders
