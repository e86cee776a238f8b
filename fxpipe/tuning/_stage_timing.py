"""Each stage's actions timed as the runtime runs them: forward, backward, and zero bubble's
input- and weight-gradient passes.

Why not the sum of the node profile (:mod:`fxpipe.plan._profile`, which balances the cut): it
times each node alone, warm, with its inputs in cache, and leaves out what runs between the
nodes (the stage's interpreter, the views it does not time, the autograd engine's
bookkeeping). Measured on one CPU thread, TinyGPT (d=64, 8 layers), a micro-batch of 16: the
profile sums forward + backward to 27-33 ms, the eager model takes 52 ms. And torch's
zero-bubble split costs more than the backward it splits: its input pass walks the autograd
graph for the parameter groups and its weight pass runs one ``autograd.grad`` per group
(that TinyGPT: a stage's input + weight pass is 1.4x its whole backward). The stages timed
here, with torch's own backward functions, are within 5-15% of the same actions in a traced
step on two gloo ranks.

How: the plan's stages are emitted from a copy of the captured graph that shares the model's
parameters, every portal carried (:func:`fxpipe.distributed._carry.carried_plan`, what
``fxpipe.distributed`` runs), and one micro-batch runs through them: each stage's forward
(with zero bubble, returning clones of what it sends, as the runtime does); then, last stage
first, its backward from the gradients of the stage after it (the last stage's: from the mean
of its floating outputs): torch's ``stage_backward``, or for zero bubble fxpipe's input pass
around torch's ``stage_backward_input`` then ``stage_backward_weight``. torch runs the first
stage's whole backward in its weight pass, and so does this. One warm-up run, then per action
the fastest of ``repeat`` (interference only adds time); on CUDA each action is synchronized.

Not in these times: what ``PipelineStage`` and fxpipe's runner do around a stage call
(flattening, checks, receives). The caller holds :func:`fxpipe.capture._prepare.preserved`
(buffers, RNG, modes); the ``.grad`` the passes accumulate into is put back here.
"""

from __future__ import annotations

import copy
import time
import statistics
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from ..distributed._carry import carried_plan
from ..distributed._split_backward import backward_pass
from ..emit._stages import Stages, emit_stages
from ..plan._profile import cuda_device_of
from ..plan._value import Plan
from ..runtime._stream import synchronize
from ._costs import StageTimes

__all__ = ["carried_stages", "time_stage_actions", "time_interleaved", "Job"]

#: one timing job: (the stages, one micro-batch's flat inputs, zero bubble's split backward)
Job = Tuple[Stages, Sequence[Any], bool]


def carried_stages(gm: fx.GraphModule, plan: Plan) -> Stages:
    """``plan``'s stages as ``fxpipe.distributed`` emits them (portals carried), from a copy
    of ``gm``'s graph: ``gm`` itself is not rewritten; the stages share its parameters."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    return emit_stages(copied, carried_plan(copied, plan))


def _timed(fn: Callable[[], Any], device: Optional[torch.device]) -> tuple[Any, float]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def _received(values: Sequence[Any]) -> List[Any]:
    """What a later stage receives: fresh leaves, needing grad where the value sent did (as
    torch's ``PipelineStage`` makes its receive buffers: a frozen prefix's output or a float
    mask gets no input gradient)."""
    return [v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v for v in values]


def _one_run(stages: Stages, micro: Sequence[Any], split: bool, device: Optional[torch.device]) -> List[List[float]]:
    """[forward, input-gradient (or whole backward), weight-gradient] seconds per stage.

    Values cross as flat leaves (a tuple of tensors is several values, as the runtime sends
    it): each stage's backward stops at its own inputs."""
    n = len(stages)
    times = [[0.0, 0.0, 0.0] for _ in range(n)]
    runs = []
    leaves: List[Any] = [v.detach() if isinstance(v, torch.Tensor) else v for v in micro]
    spec: Optional[pytree.TreeSpec] = None  # None: the model's flat inputs, as they are
    for k in range(n):
        inputs = leaves if k == 0 else _received(leaves)
        args = inputs if spec is None else pytree.tree_unflatten(inputs, spec)

        def forward(k: int = k, args: Any = args) -> List[Any]:
            with torch.enable_grad():
                out = list(stages[k](*args))
            if split:  # the input pass detach_()es what it starts from: the runtime sends clones
                out = pytree.tree_map_only(torch.Tensor, lambda o: o.clone() if o.requires_grad else o, out)
            return out

        out, times[k][0] = _timed(forward, device)
        leaves, spec = pytree.tree_flatten(out)
        runs.append((inputs, leaves))
    grads: List[Any] = []  # what the stage after sends back, one per value it received
    for k in reversed(range(n)):
        inputs, outputs = runs[k]
        kwargs = _backward_arguments(outputs, grads if k < n - 1 else None, inputs, split and k > 0)
        if kwargs is None:  # nothing of this stage's outputs reaches a loss
            grads = [None] * len(inputs)
            continue
        params = [p for p in stages[k].parameters() if p.requires_grad]
        grads, times[k][1], times[k][2] = _backward(kwargs, params, split, first=k == 0, device=device)
    return times


def _backward_arguments(outputs: List[Any], grads: Optional[List[Any]], inputs: List[Any],
                        input_pass: bool) -> Optional[dict]:
    """torch's backward arguments for a stage: from the mean of its floating outputs on the
    last stage (``grads`` None), else from the gradients the next stage sent back.
    ``input_pass``: for torch's ``stage_backward_input``, which takes the loss in a tuple."""
    if grads is None:
        floats = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if not floats:
            return None
        with torch.enable_grad():
            loss = torch.stack([o.float().mean() for o in floats]).sum()
        return {"stage_output": (loss,) if input_pass else loss, "output_grads": None, "input_values": inputs}
    sent = [i for i, o in enumerate(outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(grads[i], torch.Tensor)]
    if not sent:
        return None
    return {"stage_output": [outputs[i] for i in sent], "output_grads": [grads[i] for i in sent],
            "input_values": inputs}


def _backward(kwargs: dict, params: List[torch.nn.Parameter], split: bool, first: bool,
              device: Optional[torch.device]) -> tuple[List[Any], float, float]:
    """(the input gradients, input-pass seconds, weight-pass seconds) of one stage's backward
    as the runtime runs it; without ``split`` the whole backward counts as the input pass."""
    out, grads_in, kw = kwargs["stage_output"], kwargs["output_grads"], kwargs["input_values"]
    if not split:
        got, seconds = _timed(lambda: backward_pass("full", kwargs, params,
                                                    lambda: (stage_backward(out, grads_in, kw), None)), device)
        return list(got[0]), seconds, 0.0
    if first:  # torch: no input pass on the first stage, its whole backward in the weight pass
        _, seconds = _timed(lambda: stage_backward(out, grads_in, kw), device)
        return [None] * len(kw), 0.0, seconds
    got, input_s = _timed(lambda: backward_pass("input", kwargs, params,
                                                lambda: stage_backward_input(out, grads_in, kw, iter(params))), device)
    _, weight_s = _timed(lambda: stage_backward_weight(iter(params), got[1]), device)
    return list(got[0]), input_s, weight_s


def time_stage_actions(gm: fx.GraphModule, plan: Plan, micro: Sequence[Any], split: bool,
                       repeat: int = 3, stages: Optional[Stages] = None) -> List[StageTimes]:
    """Per stage of ``plan``, the seconds of one micro-batch's (``micro``: the model's flat
    inputs) forward, input-gradient and weight-gradient pass: with ``split`` as torch's
    zero-bubble schedules run them, else the whole backward as the input-gradient pass.
    ``stages``: :func:`carried_stages` of ``gm`` and ``plan``, when the caller made them (then
    ``plan`` is not read again)."""
    stages = stages if stages is not None else carried_stages(gm, plan)
    device = cuda_device_of(gm, micro)
    params = {id(p): p for stage in stages for p in stage.parameters()}.values()
    grads = [(p, p.grad) for p in params]
    best: Optional[List[List[float]]] = None
    try:
        for p in params:
            p.grad = None
        for i in range(max(1, repeat) + 1):
            with torch.enable_grad():  # the caller's grad mode must not turn the backwards off
                got = _one_run(stages, micro, split, device)
            for p in params:
                p.grad = None
            if i == 0:
                continue  # warm-up: first-call set-up is not a step's cost
            best = got if best is None else [[min(a, b) for a, b in zip(x, y)] for x, y in zip(best, got)]
    finally:
        for p, g in grads:
            p.grad = g
    assert best is not None
    return [StageTimes(*t) for t in best]


def time_interleaved(jobs: Sequence[Job], device: Optional[torch.device],
                     rounds: int = 5) -> List[Tuple[List[StageTimes], float]]:
    """Each job's stage times (as :func:`time_stage_actions`), robust to a load that changes
    while tune runs: one warm-up run of every job, then ``rounds`` rounds each running every
    job once (interleaved: a slow spell falls on every micro-batch size alike, not on the
    one timed then), and per action the fastest over the rounds (interference only adds time).
    The median moved with what ran between the rounds: a tiny Qwen3's last stage at 16 samples
    took a median 11.8 ms forward inside tune and 5.3 ms in the training step, and tune ranked
    chunks=1 (measured fastest) behind chunks=2 (predicted 1.38x measured, 0.96-1.02 at 2 and 4);
    the fastest round gave 1.07x / 0.93x / 0.91x and the measured order. With each job's times,
    its spread: (slowest - fastest) / median of a round's total seconds, what the load moved it
    by (measured on a shared 2-core machine: 3-40%; the fastest of three per size, timed one
    size after the other, moved predictions by up to 40% between two tunings)."""
    params = {id(p): p for stages, _, _ in jobs for stage in stages for p in stage.parameters()}.values()
    grads = [(p, p.grad) for p in params]
    runs: List[List[List[List[float]]]] = [[] for _ in jobs]
    try:
        for r in range(max(1, rounds) + 1):
            for k, (stages, micro, split) in enumerate(jobs):
                for p in params:
                    p.grad = None
                with torch.enable_grad():
                    got = _one_run(stages, micro, split, device)
                if r > 0:  # the first round warms up
                    runs[k].append(got)
    finally:
        for p, g in grads:
            p.grad = g
    out = []
    for got in runs:
        n = len(got[0])
        times = [StageTimes(*(min(run[s][i] for run in got) for i in range(3))) for s in range(n)]
        totals = [sum(map(sum, run)) for run in got]
        middle = statistics.median(totals)
        out.append((times, (max(totals) - min(totals)) / middle if middle > 0 else 0.0))
    return out
