"""Per-stage compute time of one micro-batch: forward, input-gradient and weight-gradient pass.

For a model with weights the tuner times the stages themselves (:mod:`._stage_timing`); what
is here serves the others:

* **profiled** (the fallback when a stage cannot be timed alone): ``fxpipe.plan``'s profile
  (:func:`~fxpipe.plan._profile.profile_graph`): each distinct node's forward + backward, timed
  on a micro-batch of exactly the size the configuration runs. The profile gives their sum;
  it is split as the FLOPs split: a third forward, a third input gradient and a third weight
  gradient for a node with parameters (``x @ W``: ``dX = dY @ W^T``, ``dW = X^T @ dY``, each as
  much work as the forward), a third forward and two thirds input gradient for one without.
  It leaves out what runs between nodes: on a CPU it is about half of a stage's real time.
* **roofline** (a model on the meta device, nothing to time): a node's forward takes
  ``max(flops / device_flops, bytes moved / bandwidth)``, with the FLOPs counted by
  ``torch.utils.flop_counter`` on the recorded forward and the bytes its inputs, outputs and
  parameters (:mod:`fxpipe.tuning._nodes`); its backward passes as above.

A stage's time is the sum over its nodes: within a stage nodes run one after another. Under
zero bubble torch runs the first stage's whole backward in its weight pass
(:func:`first_stage_in_weight_pass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

import torch

from ..checks._batching import Batching
from ._nodes import Recording
from ._orders import Action

__all__ = ["StageTimes", "stage_times_measured", "stage_times_roofline", "micro_inputs", "first_stage_in_weight_pass",
           "action_seconds"]


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch on one stage: forward, input-gradient, weight-gradient pass."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def first_stage_in_weight_pass(times: Sequence[StageTimes]) -> List[StageTimes]:
    """``times`` as torch's zero-bubble schedules run them: the first stage, whose inputs need
    no gradient, has no input-gradient pass; its whole backward runs in the weight pass."""
    if not times:
        return []
    first = times[0]
    return [StageTimes(first.forward, 0.0, first.backward), *times[1:]]


def action_seconds(action: Action, times: StageTimes, checkpointed: bool, split: bool) -> float:
    """Seconds of ``action`` of a stage taking ``times``. A ``checkpointed`` micro-batch's
    forward is recomputed once, in its first backward pass (fxpipe.distributed shares the
    recomputation between the passes): ``B``, ``I``, or under zero bubble (``split``) the first
    stage's ``W``, which holds its whole backward (:func:`first_stage_in_weight_pass`)."""
    kind = action.kind
    seconds = {"F": times.forward, "B": times.backward, "I": times.input_grad, "W": times.weight_grad}[kind]
    first_pass = "W" if split and action.stage == 0 else ("I" if split else "B")
    return seconds + (times.forward if checkpointed and kind == first_pass else 0.0)


def micro_inputs(batching: Batching, flat: Sequence[Any], size: int) -> List[Any]:
    """The flat inputs of one micro-batch of ``size`` samples: each split input cut (or, for
    a batch larger than the sample's, repeated) along its dim; the rest as they are."""
    out: List[Any] = []
    for d, x in zip(batching.in_dims, flat):
        if isinstance(x, torch.Tensor) and d is not None and x.dim() > 0:
            n = x.shape[d]
            if size > n:
                x = torch.cat([x] * (-(-size // n)), dim=d)
            x = x.narrow(d, 0, size)
        out.append(x)
    return out


def _split(total: float, has_params: bool) -> tuple[float, float, float]:
    third = total / 3.0
    return (third, third, third) if has_params else (third, 2.0 * third, 0.0)


def _sum(per_node: Sequence[tuple[float, float, float]], stage_of: Sequence[int], n_stages: int) -> List[StageTimes]:
    acc = [[0.0, 0.0, 0.0] for _ in range(n_stages)]
    for (f, b, w), s in zip(per_node, stage_of):
        acc[s][0] += f
        acc[s][1] += b
        acc[s][2] += w
    return [StageTimes(*a) for a in acc]


def stage_times_measured(rec: Recording, seconds: Mapping[str, float], assignment: Mapping[str, int],
                         n_stages: int) -> List[StageTimes]:
    """Stage times from profiled node seconds (forward + backward per node)."""
    per_node = [_split(float(seconds.get(r.name, 0.0)), r.grad_params > 0) for r in rec.nodes]
    return _sum(per_node, [int(assignment[r.name]) for r in rec.nodes], n_stages)


def stage_times_roofline(rec: Recording, assignment: Mapping[str, int], n_stages: int, flops_per_s: float,
                         bytes_per_s: float, efficiency: Optional[float] = None) -> List[StageTimes]:
    """Stage times from FLOPs and bytes moved (``efficiency``: the share of peak reached,
    default 1: the roofline itself, a lower bound)."""
    eff = 1.0 if efficiency is None else float(efficiency)
    per_node = []
    for r in rec.nodes:
        forward = max(r.flops / (flops_per_s * eff), r.moved / (bytes_per_s * eff))
        per_node.append((forward, forward, forward if r.grad_params else 0.0) if r.grad_params
                        else (forward, 2.0 * forward, 0.0))
    return _sum(per_node, [int(assignment[r.name]) for r in rec.nodes], n_stages)
