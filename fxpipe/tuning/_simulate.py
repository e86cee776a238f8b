"""An action list, timed: step time and bubble fraction of one training step.

Each device runs its actions in its list's order, one at a time; an action starts when its
device is free and its inputs are there:

* ``F(s, i)`` after ``F(s-1, i)``, plus the send of what stage ``s`` receives when the two
  stages are on different devices (bytes over the link: sends overlap compute, as
  torch's asynchronous ``isend`` / fxpipe's copy streams do);
* ``B(s, i)`` / ``I(s, i)`` after ``F(s, i)`` and after ``B`` or ``I`` of ``(s+1, i)`` plus the
  send of the gradient back;
* ``W(s, i)`` after ``I(s, i)``.

A send also costs both devices it joins ``overhead_s`` of their own time (the host thread
posts it, is woken by it, completes it), not overlapped with their compute: the sender's
action ends that much later for each neighbouring stage on another device it hands on to,
the receiver's for each it takes in from (once per boundary: the several tensors of one
boundary are posted together; on gloo a batch of five cost about what a batch of two did).
Microseconds for NCCL on GPUs; on gloo ranks whose processes share busy CPU cores it is
gloo's I/O thread waiting for a core: about a millisecond a send on two shared cores
(``benchmarks/_tune_dist.py`` measures it), against 0.06 ms for the same send when idle.

The step time is when the last action ends; the bubble fraction is the share of device time
spent idle, ``1 - busy / (devices * step)``: for ``K`` equal stages on ``K`` devices and
``M`` micro-batches under GPipe it is ``(K-1) / (M+K-1)``. A list whose orders wait on each
other forever is refused (``ValueError`` naming the stuck actions), never looped on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Mapping, Sequence

from ._activations import StageActivations
from ._orders import Action

__all__ = ["Timeline", "simulate", "send_bytes"]


@dataclass(frozen=True)
class Timeline:
    """When each action ran, and what that adds up to."""

    start: Dict[Action, float]
    end: Dict[Action, float]
    step_s: float
    busy_s: Dict[Hashable, float]

    @property
    def bubble(self) -> float:
        """Idle share of all devices' time over the step."""
        if self.step_s <= 0 or not self.busy_s:
            return 0.0
        return 1.0 - sum(self.busy_s.values()) / (len(self.busy_s) * self.step_s)

    def order(self) -> List[Action]:
        """Every action, by start time (ties: by end, then stage)."""
        return sorted(self.start, key=lambda a: (self.start[a], self.end[a], a.stage))


def simulate(orders: Mapping[Hashable, Sequence[Action]], duration: Callable[[Action], float],
             device_of_stage: Sequence[Hashable], send_s: Callable[[Action], float] = lambda a: 0.0,
             overhead_s: float = 0.0, after: Mapping[Action, Sequence[Action]] | None = None) -> Timeline:
    """Times ``orders`` (device -> its actions in order). ``duration(a)`` is an action's
    compute time; ``send_s(a)`` the transfer it waits for when its input comes from another
    device (``F``: the activations stage ``a.stage`` receives; ``B``/``I``: the gradient from
    stage ``a.stage + 1``); ``overhead_s`` what each send costs the two devices' own time;
    ``after``: actions an action waits for besides its inputs (a caller that waits between
    ticks: :func:`fxpipe.tuning._orders.single_process_1f1b`)."""
    waits = after or {}
    n_stages = len(device_of_stage)

    def crossings(a: Action) -> int:
        """The sends ``a`` takes in or hands on across devices (``W`` neither)."""
        if a.kind == "W":
            return 0
        step = -1 if a.kind == "F" else 1  # where its input comes from; its output goes the other way
        return sum(0 <= a.stage + d < n_stages and device_of_stage[a.stage + d] != device_of_stage[a.stage]
                   for d in (step, -step))

    kinds = {(a.stage, a.mb): a.kind for acts in orders.values() for a in acts if a.kind in "BI"}
    end: Dict[Action, float] = {}
    start: Dict[Action, float] = {}
    free = {d: 0.0 for d in orders}
    busy = {d: 0.0 for d in orders}
    pos = {d: 0 for d in orders}

    def ready(a: Action) -> float | None:
        deps: List[tuple[Action, bool]] = []  # (action, crosses devices)
        if a.kind == "F":
            if a.stage > 0:
                deps.append((Action("F", a.stage - 1, a.mb), True))
        elif a.kind in "BI":
            deps.append((Action("F", a.stage, a.mb), False))
            if a.stage < n_stages - 1:
                deps.append((Action(kinds.get((a.stage + 1, a.mb), "B"), a.stage + 1, a.mb), True))
        else:
            deps.append((Action("I", a.stage, a.mb), False))
        deps += [(w, False) for w in waits.get(a, ())]
        t = 0.0
        for dep, crosses in deps:
            if dep not in end:
                return None
            extra = 0.0
            if crosses and device_of_stage[dep.stage] != device_of_stage[a.stage]:
                extra = send_s(a)
            t = max(t, end[dep] + extra)
        return t

    remaining = sum(len(v) for v in orders.values())
    while remaining:
        progressed = False
        for d, acts in orders.items():
            while pos[d] < len(acts):
                a = acts[pos[d]]
                t = ready(a)
                if t is None:
                    break
                s = max(t, free[d])
                start[a], end[a] = s, s + duration(a) + (overhead_s * crossings(a) if overhead_s else 0.0)
                free[d] = end[a]
                busy[d] += end[a] - s
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(acts[pos[d]]) for d, acts in orders.items() if pos[d] < len(acts)]
            raise ValueError(f"the action lists wait on each other forever (next actions: {', '.join(stuck)})")
    return Timeline(start, end, max(end.values(), default=0.0), busy)


def send_bytes(a: Action, stages: Sequence[StageActivations], carried: bool) -> int:
    """The bytes ``a`` waits for from the neighbouring stage (``F``: what stage ``a.stage``
    receives; ``B``/``I``: the gradients stage ``a.stage + 1`` sends back).

    ``carried``: ``fxpipe.distributed``, which runs the carried graph: a value read two stages
    on crosses the stage between, so each send holds every value crossing the boundary
    (``boundary_out`` forward, ``boundary_grads`` back). Otherwise ``fxpipe.pipeline``, whose
    portals copy each value once, to the stage that reads it (``received``)."""
    last = len(stages) - 1
    if not carried:
        return stages[a.stage].received if a.kind == "F" else stages[min(a.stage + 1, last)].received
    if a.kind == "F":
        return stages[a.stage - 1].boundary_out if a.stage > 0 else 0
    return stages[a.stage + 1].boundary_grads if a.stage < last else 0
