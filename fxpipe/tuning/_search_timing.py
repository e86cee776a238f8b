"""How a :class:`~fxpipe.tuning._search.Search` times the stages: measured, interleaved
over micro-batch sizes, with the loss after the model; the profile's sum where a stage
cannot be timed alone; a roofline on meta.

Split from :mod:`._search` (the candidates and their ranking) to keep each small: these
methods read the search's state (``s``, the settings; its plans, recordings and stages) and
fill its caches, nothing else.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..capture._prepare import preserved
from ..errors import FxpipeError
from ..plan._profile import cuda_device_of, profile_graph
from ..plan._value import Plan
from ._costs import StageTimes, first_stage_in_weight_pass, stage_times_measured, stage_times_roofline
from ._loss_memory import DEFAULT as DEFAULT_LOSS
from ._loss_memory import LossMemory, measure_loss_memory
from ._loss_timing import first_samples, time_loss
from ._memory import torch_run
from ._stage_timing import carried_stages, time_interleaved, time_stage_actions

__all__ = ["Timing"]


def _first_line(error: BaseException) -> str:
    """The error that started it (torch's stage_backward wraps its cause in a message that
    begins with a blank line): its type and first line."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class Timing:
    """The timing half of :class:`~fxpipe.tuning._search.Search` (a mixin: every attribute
    used here is set by ``Search.__init__``)."""

    s: Any
    model: Any
    checked: Any
    _seconds: Dict[int, Dict[str, float]]
    _stages: Dict[int, Any]
    _timed: Dict[Tuple[int, int, bool], List[StageTimes]]
    untimed: List[str]
    spreads: Dict[Tuple[int, int, bool], float]
    loss_s: Dict[int, Tuple[float, float]]
    loss_mem: Dict[int, LossMemory]
    meta: bool
    refused: Dict[int, str]

    def seconds(self, size: int) -> Dict[str, float]:
        if size not in self._seconds:
            with preserved(self.model):
                costs = profile_graph(self.checked.capture.graph_module, self.micro(size))
            self._seconds[size] = {name: c.seconds for name, c in costs.items()}
        return self._seconds[size]

    def times(self, plan: Plan, size: int, split: bool) -> List[StageTimes]:
        """Per stage, one micro-batch's forward, input- and weight-gradient seconds (``split``:
        as torch's zero-bubble schedules run them), the loss's in the last stage's when given.
        With weights: the stages timed as they run (:mod:`._stage_timing`; interleaved with
        every other size when :meth:`time_ahead` ran), or the profile's sum if that fails; on
        meta: the roofline."""
        if self.s.device_flops is not None:
            rec = self.record(size)
            times = stage_times_roofline(rec, plan.assignment, plan.n_stages, self.s.device_flops,
                                         self.s.bandwidth or float("inf"), self.s.efficiency)
            return first_stage_in_weight_pass(times) if split else times
        key = (plan.n_stages, size, split)
        if key not in self._timed:
            try:
                if plan.n_stages not in self._stages:
                    self._stages[plan.n_stages] = carried_stages(self.checked.capture.graph_module, plan)
                with preserved(self.model):
                    self._timed[key] = time_stage_actions(self.checked.capture.graph_module, plan, self.micro(size),
                                                          split, stages=self._stages[plan.n_stages])
            except (RuntimeError, FxpipeError) as e:  # torch's or fxpipe's refusal: the profile still predicts
                self.untimed.append(f"{plan.n_stages} stages, micro-batch {size}: {_first_line(e)}"[:200])
                times = stage_times_measured(self.record(size), self.seconds(size), plan.assignment, plan.n_stages)
                self._timed[key] = first_stage_in_weight_pass(times) if split else times
        return self._with_loss(self._timed[key], size)

    def _with_loss(self, times: List[StageTimes], size: int) -> List[StageTimes]:
        if self.s.loss_fn is None:
            return times
        if size not in self.loss_s:
            args, kwargs = first_samples((self.checked.args, self.checked.kwargs), size)
            target = first_samples(self.s.target, size)
            with preserved(self.model):
                self.loss_s[size] = time_loss(self.model, args, kwargs, self.s.loss_fn, target,
                                              device=cuda_device_of(self.checked.capture.graph_module, self.micro(size)))
        f, b = self.loss_s[size]
        last = times[-1]
        return [*times[:-1], StageTimes(last.forward + f, last.input_grad + b, last.weight_grad)]

    def loss_memory(self, size: int) -> LossMemory:
        """The loss's memory above a micro-batch of ``size`` samples' output, measured
        (:mod:`._loss_memory`) where there are weights and a ``loss_fn``; else the constant."""
        if self.s.loss_fn is None or self.s.device_flops is not None or self.meta:
            return DEFAULT_LOSS
        if size not in self.loss_mem:
            args, kwargs = first_samples((self.checked.args, self.checked.kwargs), size)
            try:
                with preserved(self.model):
                    self.loss_mem[size] = measure_loss_memory(self.model, args, kwargs, self.s.loss_fn,
                                                              first_samples(self.s.target, size))
            except (RuntimeError, FxpipeError):  # the timing reports a loss that fails
                self.loss_mem[size] = DEFAULT_LOSS
        return self.loss_mem[size]

    def time_ahead(self, rounds: int = 5) -> None:
        """Times every (stage count, micro-batch size, split) the candidates need in one
        :func:`time_interleaved` call, so that a load changing while tune runs moves every
        size alike; what fails here is timed alone by :meth:`times` (or falls back)."""
        if self.s.device_flops is not None:
            return
        keys = []
        for schedule, local in self.candidates():
            n_stages, where = self.layout(schedule, local)
            split = not local and torch_run(schedule, where).split
            keys += [(n_stages, self.s.batch // c, split) for c in self.s.chunks
                     if self.s.batch % c == 0 and c not in self.refused]
        keys = list(dict.fromkeys(keys))
        gm = self.checked.capture.graph_module
        try:
            jobs = []
            for n_stages, size, split in keys:
                if n_stages not in self._stages:
                    self._stages[n_stages] = carried_stages(gm, self.plan(n_stages))
                jobs.append((self._stages[n_stages], self.micro(size), split))
            with preserved(self.model):
                got = time_interleaved(jobs, cuda_device_of(gm, self.micro(keys[0][1])) if keys else None, rounds)
        except (RuntimeError, FxpipeError):
            return
        for key, (times, spread) in zip(keys, got):
            self._timed[key], self.spreads[key] = times, spread
