"""The candidates, each predicted, and their ranking.

A candidate is (schedule, front door, stages, chunks, checkpoint mode). ``'gpipe'`` is
``fxpipe.pipeline``: one process, one stage per device, the runtime's clock cycles; so is
``'1f1b'`` in one process (``Pipeline.step``: each micro-batch's backward between two forward
ticks). ``'1f1b'`` and the others are also ``fxpipe.distributed`` with torch's schedule of
that name: one rank per device, one stage per rank (two for the interleaved and V schedules).
Each stage count gets one plan (``fxpipe.plan``: balanced by ``balance_by``; by default
profiled time for a model with weights, parameters on meta), and each micro-batch size one recorded forward (:mod:`._nodes`; with four sizes or more,
two recorded and the others derived where shapes are linear in the size, checked on the
largest: :mod:`._scaling`) and, with weights, one timed run of each stage count's stages
(:mod:`._stage_timing`; both backward modes where zero bubble is a candidate): everything a
candidate needs is then arithmetic on those (:mod:`._activations`, :mod:`._costs`,
:mod:`._simulate`, :mod:`._memory`), so thousands of candidates cost milliseconds each.

Ranking: those that fit the memory first, by predicted step time (less peak memory breaks a
tie); a configuration that fits nowhere says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple


from ..build import Checked
from ..capture._prepare import preserved
from ..emit._stages import Stages
from ..errors import StagesError
from ..plan._make import make_plan
from ..plan._value import Plan
from ._activations import StageActivations, stage_activations
from ._costs import StageTimes, action_seconds, micro_inputs
from ._device_memory import device_memory
from ._loss_memory import LossMemory
from ._memory import torch_run
from ._nodes import Recording, record_nodes
from ..runtime._orders import SCHEDULES as LOCAL_SCHEDULES  # what fxpipe.pipeline runs in one process
from ._orders import (DISTRIBUTED_SCHEDULES, Action, placement, single_process_1f1b, single_process_order,
                      torch_orders)
from ._result import Choice
from ._search_timing import Timing, _first_line
from ._scaling import derive, fit, same
from ._simulate import send_bytes, simulate
from ._tensors import StageTensors, once_per_device, stage_tensors
from ._units import format_bytes

__all__ = ["Settings", "Search", "ranked"]


@dataclass
class Settings:
    """What the user asked for, checked and in numbers."""

    devices: List[str]               # one label per device (repeats share a device)
    memory: Optional[float]          # bytes per device (None: no limit)
    batch: int
    schedules: Sequence[str]
    checkpoints: Sequence[str]
    chunks: Sequence[int]
    link: float                      # bytes per second between devices
    latency: float                   # seconds of every send between devices, whatever its size
    optimizer: str
    device_flops: Optional[float] = None
    bandwidth: Optional[float] = None
    efficiency: Optional[float] = None
    torch_devices: Optional[List[Any]] = None  # the devices fxpipe.pipeline gets (None: labels only)
    skipped: Dict[str, str] = field(default_factory=dict)
    balance_by: Optional[str] = None  # None: 'time' with weights, 'params' on meta
    zero_grad: str = "set_to_none"    # how .grad is cleared: 'in_place' keeps it through the backward
    send_overhead: float = 0.0        # seconds of each device's own time a send between devices costs
    #: build options tune was given, passed on to the front door that builds a choice:
    #: leaf_modules to both, chunk_dims and output_merge to fxpipe.pipeline
    build: Dict[str, Any] = field(default_factory=dict)
    #: the loss after the model (``tune(loss_fn=, target=)``), timed into the last stage
    loss_fn: Optional[Callable[..., Any]] = None
    target: Any = None


class Search(Timing):
    """Plans, recordings and profiles, made once each, and the candidates predicted on them."""

    def __init__(self, model: Any, checked: Checked, settings: Settings, progress: Any,
                 shared: Optional["Search"] = None) -> None:
        """``shared``: a search of the same model and sample (another device count or batch,
        :mod:`._data_parallel`) whose per-micro-batch-size work this one reuses: recordings,
        node profiles and loss timings depend on the size alone."""
        self.model, self.checked, self.s, self.progress = model, checked, settings, progress
        self.meta = checked.meta
        self.flat = checked.capture.flatten_inputs(checked.args, checked.kwargs)
        self._plans: Dict[int, Plan] = {}
        self._records: Dict[int, Recording] = shared._records if shared is not None else {}
        self._seconds: Dict[int, Dict[str, float]] = shared._seconds if shared is not None else {}
        self._stages: Dict[int, Stages] = {}
        self._plan_errors: Dict[int, StagesError] = {}
        #: chunk counts whose micro-batch the model cannot run, and why (:meth:`refuse_sizes`)
        self.refused: Dict[int, str] = {}
        self._tensors: Dict[int, StageTensors] = {}
        self._timed: Dict[Tuple[int, int, bool], List[StageTimes]] = {}
        #: why stage timing fell back to the profile, if it did (one line each)
        self.untimed: List[str] = []
        self._acts: Dict[Tuple[int, int, Tuple[int, ...], bool], List[StageActivations]] = {}
        self._orders: Dict[Tuple[str, bool, int], Dict[Hashable, List[Action]]] = {}
        #: per (schedule, local, chunks): what an action waits for besides its inputs
        self.waits: Dict[Tuple[str, bool, int], Dict[Action, List[Action]]] = {}
        self._fit: Any = None  # None: not tried; False: the sizes are recorded one by one
        #: micro-batch sizes recorded, and derived from two of them (checked on a third)
        self.recorded: List[int] = []
        self.derived: List[int] = []
        #: per (stages, micro-batch size, split): the spread of its interleaved timing rounds
        self.spreads: Dict[Tuple[int, int, bool], float] = {}
        #: per micro-batch size: the loss's (forward, backward) seconds (``loss_fn``)
        self.loss_s: Dict[int, Tuple[float, float]] = shared.loss_s if shared is not None else {}
        #: per micro-batch size: the loss's memory above the output (``loss_fn``, with weights)
        self.loss_mem: Dict[int, LossMemory] = shared.loss_mem if shared is not None else {}

    # -- made once -----------------------------------------------------------------------------
    def plan(self, n_stages: int) -> Plan:
        """The plan of ``n_stages`` (profiled, with 'time', on the smallest micro-batch that
        runs); raises :class:`~fxpipe.errors.StagesError` (kept) when the graph has too few
        nodes to cut that often."""
        if n_stages in self._plan_errors:
            raise self._plan_errors[n_stages]
        if n_stages not in self._plans:
            chunks = max(c for c in self.s.chunks if c not in self.refused)
            balance_by = self.s.balance_by or ("params" if self.meta else "time")
            try:
                with preserved(self.model):
                    self._plans[n_stages] = make_plan(self.checked.capture, self.checked.args, self.checked.kwargs,
                                                      n_stages, balance_by=balance_by, chunks=chunks,
                                                      batching=self.checked.batching, progress=self.progress)
            except StagesError as e:
                self._plan_errors[n_stages] = e
                raise
        return self._plans[n_stages]

    def refuse_sizes(self) -> None:
        """Each chunk count whose micro-batch the model cannot run (a BatchNorm in training
        mode given one sample) is refused with the model's reason, recorded once; the others
        are planned and predicted without it."""
        for chunks in self.s.chunks:
            if self.s.batch % chunks == 0:
                try:
                    self.record(self.s.batch // chunks)
                except (ValueError, RuntimeError) as e:
                    self.refused[chunks] = (f"the model refuses a micro-batch of {self.s.batch // chunks} "
                                            f"(chunks={chunks}): {_first_line(e)}")[:300]

    def tensors(self, plan: Plan) -> StageTensors:
        """Per stage, the parameters, buffers and constants it reads, by identity
        (:mod:`._tensors`: a tensor tied between stages on one device counts once there)."""
        if plan.n_stages not in self._tensors:
            self._tensors[plan.n_stages] = stage_tensors(self.checked.capture.graph_module, plan)
        return self._tensors[plan.n_stages]

    def micro(self, size: int) -> List[Any]:
        return micro_inputs(self.checked.batching, self.flat, size)

    def record(self, size: int) -> Recording:
        """One micro-batch's recording: recorded, or derived (:mod:`._scaling`) when the
        tuner needs four sizes or more above 1 and the two smallest give the largest exactly."""
        if size not in self._records:
            derived = self._derive(size)
            self._records[size] = derived if derived is not None else self._record_now(size)
        return self._records[size]

    def _record_now(self, size: int) -> Recording:
        if size not in self._records:
            with preserved(self.model):
                self._records[size] = record_nodes(self.checked.capture.graph_module, self.micro(size))
            self.recorded.append(size)
        return self._records[size]

    def _derive(self, size: int) -> Optional[Recording]:
        # size 1 is recorded as it is: there, reshapes and contiguous() of a batch dim of
        # one return views, which larger sizes copy (other storages, not a linear change)
        sizes = sorted({self.s.batch // c for c in self.s.chunks if self.s.batch % c == 0} - {1})
        if size not in sizes or len(sizes) < 4:
            return None
        if self._fit is None:
            s1, s2, largest = sizes[0], sizes[1], sizes[-1]
            found = fit(self._record_now(s1), s1, self._record_now(s2), s2)
            check = derive(found, largest) if found is not None else None
            self._fit = found if check is not None and same(check, self._record_now(largest)) else False
        if self._fit is False or size in self._records:
            return None
        got = derive(self._fit, size)
        if got is not None:
            self.derived.append(size)
        return got

    # -- one candidate -------------------------------------------------------------------------
    def layout(self, schedule: str, local: bool = False) -> Tuple[int, List[Hashable]]:
        """(stages, the device of each stage); ``local``: ``fxpipe.pipeline``, one stage per device."""
        n = len(self.s.devices)
        if local:
            return n, list(self.s.devices)
        spr = DISTRIBUTED_SCHEDULES[schedule]
        return n * spr, [self.s.devices[r] for r in placement(schedule, n, spr)]

    def orders(self, schedule: str, n_stages: int, chunks: int, where: List[Hashable],
               local: bool = False) -> Dict[Hashable, List[Action]]:
        """Each device's actions, built once per (schedule, front door, chunks): every
        checkpoint mode runs the same order (torch's classes take a while to build theirs).
        ``local``: ``fxpipe.pipeline``'s runtime, whose 1F1B also waits between ticks
        (:attr:`waits`)."""
        key = (schedule, local, chunks)
        if key not in self._orders:
            if local:
                if schedule == "gpipe":
                    order, self.waits[key] = single_process_order(n_stages, chunks), {}
                else:
                    order, self.waits[key] = single_process_1f1b(n_stages, chunks)
                self._orders[key] = {d: [a for a in order if where[a.stage] == d] for d in dict.fromkeys(where)}
            else:
                by_rank = torch_orders(schedule, len(self.s.devices), chunks)
                self._orders[key] = {self.s.devices[r]: acts for r, acts in by_rank.items()}
        return self._orders[key]

    def predict(self, schedule: str, chunks: int, mode: str, local: bool = False) -> Choice:
        """One candidate; ``local``: run by ``fxpipe.pipeline`` (one process), else by
        ``fxpipe.distributed`` (a rank per device)."""
        n_stages, where = self.layout(schedule, local)
        choice = Choice(schedule, n_stages, chunks, mode, one_process=local)
        if self.s.batch % chunks:
            choice.fits, choice.why = False, f"chunks={chunks} does not divide the batch of {self.s.batch}"
            return choice
        if chunks in self.refused:
            choice.fits, choice.why = False, self.refused[chunks]
            return choice
        try:
            orders = self.orders(schedule, n_stages, chunks, where, local)
        except ValueError as e:  # torch's schedule refuses this chunks for this world size
            choice.fits, choice.why = False, f"torch's schedule refuses it: {str(e).splitlines()[0]}"
            return choice
        try:
            plan = self.plan(n_stages)
        except StagesError as e:
            choice.fits, choice.why = False, f"cannot be cut into {n_stages} stages: {_first_line(e)}"[:300]
            return choice
        size = self.s.batch // chunks
        pools = [list(dict.fromkeys(where)).index(d) for d in where]
        acts = self._activations(plan, size, tuple(pools), received_static=not local)
        run = False if local else torch_run(schedule, where)
        split = bool(run and run.split)
        times = self.times(plan, size, split)
        stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]

        def duration(a: Action) -> float:
            return action_seconds(a, times[a.stage], a.mb < stop, split)

        def send(a: Action) -> float:
            sent = send_bytes(a, acts, carried=not local)
            return self.s.latency + sent / self.s.link if sent else 0.0

        timeline = simulate(orders, duration, where, send, self.s.send_overhead,
                            after=self.waits.get((schedule, local, chunks)))
        choice.step_s, choice.bubble = timeline.step_s, timeline.bubble
        choice.plan = plan
        for label, (static, above) in self.memory(choice, self.s.zero_grad).items():
            choice.static_bytes[label], choice.activation_bytes[label] = static, above
            choice.peak_bytes[label] = static + above
        choice.kwargs = self._kwargs(schedule, n_stages, chunks, mode, plan, local)
        if self.s.memory is not None and choice.peak > self.s.memory:
            worst = max(choice.peak_bytes, key=choice.peak_bytes.__getitem__)
            choice.fits = False
            choice.why = (f"needs {format_bytes(choice.peak)} on device {worst} "
                          f"(parameters, gradients and optimizer state {format_bytes(choice.static_bytes[worst])}, "
                          f"activations {format_bytes(choice.activation_bytes[worst])})")
        return choice

    def memory(self, choice: Choice, zero_grad: str) -> Dict[str, Tuple[float, float]]:
        """Per device label: (static bytes, activation bytes above them at the peak) of a
        predicted ``choice`` (:mod:`._device_memory`), with ``.grad`` cleared as ``zero_grad``
        says: the search's own setting, or ``'set_to_none'`` for a stage whose gradients are
        made anew every step whatever the optimizer does (FSDP's whole gradients,
        :mod:`._sharded`). Cheap: the orders and activations are made once."""
        assert choice.plan is not None
        local, schedule, chunks, plan = choice.one_process, choice.schedule, choice.chunks, choice.plan
        n_stages, where = self.layout(schedule, local)
        orders = self.orders(schedule, n_stages, chunks, where, local)
        pools = [list(dict.fromkeys(where)).index(d) for d in where]
        acts = self._activations(plan, self.s.batch // chunks, tuple(pools), received_static=not local)
        run = False if local else torch_run(schedule, where)
        # parameters, buffers, gradients and optimizer state: each tensor once per device
        params, trained = once_per_device(self.tensors(plan), where)
        memory = device_memory(orders, acts, choice.checkpoint, chunks, gpipe=local and schedule == "gpipe", run=run,
                               params=params, trained=trained, where=where, optimizer=self.s.optimizer,
                               zero_grad=zero_grad, loss=self.loss_memory(self.s.batch // chunks))
        return {str(d): parts for d, parts in memory.items()}

    def _activations(self, plan: Plan, size: int, pools: Tuple[int, ...],
                     received_static: bool) -> List[StageActivations]:
        key = (plan.n_stages, size, pools, received_static)
        if key not in self._acts:
            self._acts[key] = stage_activations(self.record(size), plan.assignment, plan.n_stages, list(pools),
                                                received_static)
        return self._acts[key]

    def _kwargs(self, schedule: str, n_stages: int, chunks: int, mode: str, plan: Plan,
                local: bool) -> Dict[str, Any]:
        if local:
            kwargs: Dict[str, Any] = {"n_stages": n_stages, "chunks": chunks, "checkpoint": mode, "plan": plan,
                                      **self.s.build}
            if schedule != "gpipe":
                kwargs["schedule"] = schedule
            if self.s.torch_devices is not None:
                kwargs["devices"] = list(self.s.torch_devices)
            return kwargs
        leaves = {k: v for k, v in self.s.build.items() if k == "leaf_modules"}
        return {"chunks": chunks, "schedule": schedule, "stages_per_rank": DISTRIBUTED_SCHEDULES[schedule],
                "checkpoint": mode, "plan": plan, **leaves}

    def candidates(self) -> List[Tuple[str, bool]]:
        """(schedule, run by fxpipe.pipeline): 'gpipe' in one process; '1f1b' in one process
        (``fxpipe.pipeline(schedule='1f1b')``) and on ranks; the others on ranks. Distributed
        ones the settings skip (devices that repeat) are left out."""
        found = []
        for schedule in self.s.schedules:
            if schedule in LOCAL_SCHEDULES:
                found.append((schedule, True))
            if schedule != "gpipe" and schedule not in self.s.skipped:
                found.append((schedule, False))
        return found

    def _same_as_gpipe(self, schedule: str, local: bool, chunks: int) -> bool:
        """One micro-batch in one process: 1F1B runs GPipe's order, listed once (as 'gpipe')."""
        return local and schedule == "1f1b" and chunks == 1 and "gpipe" in self.s.schedules

    def _same_as_never(self, chunks: int, mode: str) -> bool:
        """``'except_last'`` with one micro-batch checkpoints nothing: the run of ``'never'``,
        listed once (as ``'never'``) when both are candidates."""
        return chunks == 1 and mode == "except_last" and "never" in self.s.checkpoints

    def run(self) -> List[Choice]:
        self.refuse_sizes()
        self.time_ahead()
        choices = [self.predict(schedule, chunks, mode, local)
                   for schedule, local in self.candidates()
                   for chunks in self.s.chunks for mode in self.s.checkpoints
                   if not self._same_as_never(chunks, mode) and not self._same_as_gpipe(schedule, local, chunks)]
        return ranked(choices)


def ranked(choices: List[Choice]) -> List[Choice]:
    """Those that fit first, fastest first; less peak memory breaks a tie."""
    return sorted(choices, key=lambda c: (not c.fits, c.step_s if c.fits else float("inf"), c.peak))
