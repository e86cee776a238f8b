"""The memory floor of one pipelined training step, from measured quantities.

A GPipe step on one memory pool (every stage on one device) splits the batch of ``B``
samples into ``m`` micro-batches of ``b = B / m`` and runs tasks ``(i, j)`` (micro-batch
``i`` on stage ``j``). Backward follows two orders that every GPipe implementation keeps:
data (stage ``j`` after stage ``j+1``) and GPipe's reverse order on each stage (``(i-1, j)``
after ``(i, j)``). Hence, while the **last** micro-batch's backward runs on stage ``p``,
no other task ``(i, j)`` with ``j <= p`` has run its backward yet, and whatever it needs
later is still held. What it needs depends on the checkpoint mode:

* checkpointed task: its *boundary inputs*, the distinct tensors stage ``j`` receives
  (arguments from stage ``j-1`` and portal values popped from earlier stages), kept for
  its recomputation; ``s_j`` bytes per micro-batch (:func:`received_bytes`);
* task run without checkpointing: what its forward saved for backward, ``a_j`` bytes
  (:func:`saved_bytes`).

The last micro-batch costs, phase by phase, what one eager step of ``b`` samples through the
stage modules costs (:func:`last_micro_batch_phases`): ``E_p``, the peak during its stage
``p``'s backward (``E_{n-1}`` also covers the merged output and the loss). Its step's loss
runs over the merged output of all ``B`` samples, the other micro-batches' outputs made
before the measured step (the pipeline could free each once merged), their gradients held
until the last stage's backward is done (the pipeline's other micro-batches have not used
them yet). With every micro-batch checkpointed, the last one costs stage ``p``'s
recomputation and backward alone, ``E'_p`` (:func:`stage_alone_peaks`), its own inputs
included. So, for ``m`` micro-batches (:func:`floors`)::

    never       : max_p  (m-1) * a_{<=p} + E_p
    except_last : max_p  (m-1) * s_{<=p} + E_p        (the last micro-batch is not checkpointed)
    always      : max_p      m * s_{<=p} - s_p + E'_p

where ``x_{<=p}`` sums stages ``0..p``. Each term is held at one moment of *every*
implementation, so each max is a floor: less memory would mean dropping something a later
step reads. It leaves out what an implementation can avoid: micro-batch outputs before they
are merged, copies, RNG states of stages that draw no random number, and the transient
memory of the other micro-batches' tasks.

Bytes are distinct storages allocated during the step: the user's input (its micro-batch
slices are views), parameters, buffers and ``.grad`` (made by a warm-up step) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from fxpipe.runtime._stage_portals import LocalPortals, swap_portals
from fxpipe.tree import flatten, unflatten

from _memory import Meter

#: the mark that ends the last micro-batch's forward (marks 0..n-1: stage p's backward is done)
FORWARD_DONE = 999


def tensors(value: Any) -> List[Tensor]:
    """Tensor leaves of any value crossing a stage."""
    return [x for x in flatten(value)[0] if isinstance(x, Tensor)]


def storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class StageIO:
    """What stage ``j`` received and made for one micro-batch."""

    args: List[Any]
    popped: Dict[str, Any] = field(default_factory=dict)
    stashed: Dict[str, Any] = field(default_factory=dict)
    output: List[Any] = field(default_factory=list)

    def received(self) -> List[Tensor]:
        return tensors(self.args) + tensors(list(self.popped.values()))


class _Recording(LocalPortals):
    """Stage portals outside a pipeline that also remember what each stage popped and stashed."""

    def __init__(self, receive: Optional[Callable[[Any], Any]] = None) -> None:
        super().__init__()
        self.io: Optional[StageIO] = None
        self.receive = receive

    def stash(self, name: str, value: Any) -> None:
        super().stash(name, value)
        if self.io is not None:
            self.io.stashed[name] = value

    def pop(self, name: str) -> Any:
        value = super().pop(name)
        if self.receive is not None:
            value = self.receive(value)
        if self.io is not None:
            self.io.popped[name] = value
        return value


def walk(stages: Sequence[Callable[..., Any]], leaves: Sequence[Any],
         before: Optional[Callable[[int], None]] = None,
         after: Optional[Callable[[int, StageIO], None]] = None, keep: bool = True,
         receive: Optional[Callable[[Any], Any]] = None) -> List[StageIO]:
    """Runs the stages one after the other on one micro-batch's flat input leaves, as the
    pipeline calls them (each value of the previous output as a positional argument).

    Returns every stage's :class:`StageIO`; with ``keep=False`` only the last one, so
    values between stages live no longer than the stages' own graphs keep them (as in an
    eager forward): ``after(j, io)`` sees each one meanwhile. ``receive`` transforms each
    value a stage ``j >= 1`` receives (argument or pop) before the stage reads it."""
    portals = _Recording(receive)
    previous = swap_portals(portals)
    ios: List[StageIO] = []
    try:
        values = list(leaves)
        for j, stage in enumerate(stages):
            if before is not None:
                before(j)
            if receive is not None and j > 0:
                values = [receive(v) for v in values]
            portals.io = io = StageIO(values)
            out = stage(*values)
            io.output = list(out) if isinstance(out, tuple) else [out]
            del out
            if after is not None:
                after(j, io)
            if keep or j == len(stages) - 1:
                ios.append(io)
            values = io.output
            del io
        portals.io = None
    finally:
        swap_portals(previous)
    return ios


def first_received(ios: Sequence[StageIO], exclude: Set[int]) -> List[List[Tensor]]:
    """Per stage, the tensors whose storage it is the first stage to receive (one per
    storage; storages in ``exclude`` -- existing before the step -- left out)."""
    seen = set(exclude)
    per_stage: List[List[Tensor]] = []
    for io in ios:
        mine = []
        for t in io.received():
            key = storage_key(t)
            if key not in seen and t.untyped_storage().nbytes():
                seen.add(key)
                mine.append(t)
        per_stage.append(mine)
    return per_stage


def received_bytes(stages: Sequence[Callable[..., Any]], leaves: Sequence[Any], exclude: Set[int]) -> List[int]:
    """``s_j``: bytes of the distinct storages stage ``j`` receives for one micro-batch."""
    with torch.no_grad():
        ios = walk(stages, leaves)  # kept alive: no storage is reused while counting
        return [sum(t.untyped_storage().nbytes() for t in mine) for mine in first_received(ios, exclude)]


def saved_bytes(stages: Sequence[Callable[..., Any]], leaves: Sequence[Any], exclude: Set[int]) -> List[int]:
    """``a_j``: bytes of the distinct storages stage ``j``'s forward saves for backward."""
    stage = [0]
    seen = set(exclude)
    per_stage = [0] * len(stages)

    def pack(t: Tensor) -> Tensor:
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            per_stage[stage[0]] += nbytes
        return t

    def before(j: int) -> None:
        stage[0] = j

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ios = walk(stages, leaves, before)  # the graph keeps every saved tensor alive meanwhile
    del ios
    return per_stage


Merge = Callable[[List[List[Any]]], Any]
Loss = Callable[[Any], None]


def last_micro_batch_phases(stages: Sequence[Callable[..., Any]], leaves: Sequence[Any], rest: List[List[Any]],
                            merge: Merge, loss: Loss, device: torch.device) -> List[Dict[str, int]]:
    """``E_p``: one eager step of the last micro-batch through the stages, its peak per phase.

    ``rest`` are the other micro-batches' outputs (made beforehand); ``merge`` builds the
    step's output from all of them, ``loss`` runs the step's loss and backward on it.
    Phases end at marks: the forward's end, then each stage's backward (every tensor it
    receives, seen through a view of its own, has its gradient: the stage's part of that
    gradient is complete, whatever other stages still add). Returns one ``{'held_stage', 'peak_bytes'}``
    per phase, ``held_stage`` = ``p`` for stage ``p``'s backward (``-1``: the forward). A phase
    is labelled by the mark that ends it, so a missing mark merges two phases under the
    smaller ``p``, which only lowers the floor.
    """
    meter = Meter(device)
    n = len(stages)
    others = _needing_grad(rest)

    def drop_others_grads() -> None:
        for t in tensors(others):
            t.grad = None

    def step() -> None:
        def watch(p: int, io: StageIO) -> None:
            if p > 0:
                _mark_when_all_grads(meter, p, [t for t in io.received() if t.requires_grad],
                                     then=drop_others_grads if p == n - 1 else None)

        output = walk(stages, leaves, after=watch, keep=False, receive=_own_view)[-1].output
        meter.mark(FORWARD_DONE)
        out = merge(others + [output])
        del output
        loss(out)

    result = meter.run(step)
    phases = result["phases"]
    ends = [ph["label"] for ph in phases[1:]] + [0]  # after the last mark: stage 0's backward
    return [{"held_stage": -1 if end == FORWARD_DONE else end, "peak_bytes": ph["peak_bytes"]}
            for ph, end in zip(phases, ends)]


def _own_view(value: Any) -> Any:
    """``value`` with each tensor that requires grad replaced by a view of it: a view's
    gradient is the receiving stage's part alone (no allocation: a view shares storage)."""
    leaves, spec = flatten(value)
    return unflatten([x.view_as(x) if isinstance(x, Tensor) and x.requires_grad else x for x in leaves], spec)


def _needing_grad(rest: List[List[Any]]) -> List[List[Any]]:
    """The other micro-batches' outputs as leaves that require grad, so the merged output's
    backward hands them their gradients: a pipeline holds those until each micro-batch's
    last stage runs its backward, hence at least while the last micro-batch's does."""
    return [[_leaf(v) for v in output] for output in rest]


def _mark_when_all_grads(meter: Meter, p: int, watched: List[Tensor],
                         then: Optional[Callable[[], None]] = None) -> None:
    left = [len(watched)]

    def hook(grad: Tensor) -> None:
        left[0] -= 1
        if left[0] == 0:
            meter.mark(p)
            if then is not None:
                then()

    for t in watched:
        t.register_hook(hook)


def stage_alone_peaks(stages: Sequence[Callable[..., Any]], ios: Sequence[StageIO], rest: List[List[Any]],
                      merge: Merge, loss: Loss, exclude: Set[int], device: torch.device) -> List[int]:
    """``E'_p``: the peak of stage ``p``'s recomputation and backward for one micro-batch.

    The tensors stage ``p`` is the first to receive are made (copied) in the measurement
    and left to autograd, which drops each once the backward that reads it ran, as the
    stage's own input can go once the stage's backward is done with it; earlier stages'
    values it also reads are in place. The gradients of its outputs and stashes are made in
    the measurement. For the last stage these come from the step's loss, run first on the
    stage's output made without grad (the checkpointed forward): the loss's temporaries
    are gone before the recomputation starts, as in the pipeline.
    """
    peaks = []
    n = len(stages)
    owned = [{storage_key(t) for t in mine} for mine in first_received(ios, exclude)]
    for p, (stage, io) in enumerate(zip(stages, ios)):

        def inputs(io: StageIO = io, owned: Set[int] = owned[p]) -> Tuple[List[Any], Dict[str, Any]]:
            def own(value: Any) -> Any:
                return _leaf(value, copy=lambda t: storage_key(t) in owned)
            return [own(v) for v in io.args], {k: own(v) for k, v in io.popped.items()}

        def step(stage: Callable[..., Any] = stage, inputs: Callable[[], Tuple[List[Any], Dict[str, Any]]] = inputs,
                 last: bool = p == n - 1) -> None:
            args, popped = inputs()
            grads: List[Optional[Tensor]] = []
            if last:
                with torch.no_grad():
                    first = _run(stage, args, popped)[0]
                first = _catching(first, grads)
                out = merge(_needing_grad(rest) + [first])  # held, like the step's output variable
                del first
                loss(out)
            output, stashed = _run(stage, args, popped)
            del args, popped  # the recomputed graph holds what it saved
            ys = tensors(output) + tensors(list(stashed.values()))
            del output, stashed
            if not last:
                grads = [torch.ones_like(y) for y in ys]
            _backward(ys, grads)

        peaks.append(Meter(device).run(step)["peak_bytes"])
    return peaks


class _Catch(torch.autograd.Function):
    """``x`` (a view) whose backward puts its gradient in ``caught[i]``; the node keeps no
    reference to ``x``, so ``x`` lives no longer than its users (a leaf would be kept alive
    by its ``AccumulateGrad`` node for as long as the graph)."""

    @staticmethod
    def forward(ctx, caught: List[Optional[Tensor]], i: int, phony: Tensor, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.caught, ctx.i = caught, i
        return x.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[None, None, None, None]:  # type: ignore[override]
        ctx.caught[ctx.i] = grad
        return None, None, None, None


def _catching(output: List[Any], caught: List[Optional[Tensor]]) -> List[Any]:
    """``output`` (made without grad) with its tensors' gradients going to ``caught``, one
    slot per tensor leaf in order (None: no gradient came)."""
    leaves, spec = flatten(output)
    made = []
    for x in leaves:
        if isinstance(x, Tensor):
            caught.append(None)
            if x.is_floating_point() or x.is_complex():
                phony = torch.empty(0, device=x.device, requires_grad=True)  # makes the output need grad
                x = _Catch.apply(caught, len(caught) - 1, phony, x)
        made.append(x)
    return unflatten(made, spec)


class _Seed(torch.autograd.Function):
    """A root whose backward hands given gradients to tensors, so that backward does not keep
    the tensors themselves alive (a ``backward(tensors, grads)`` call holds its arguments)."""

    @staticmethod
    def forward(ctx, grads: List[Tensor], *ys: Tensor) -> Tensor:  # type: ignore[override]
        ctx.grads = grads
        return torch.zeros((), device=ys[0].device)

    @staticmethod
    def backward(ctx, _: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


def _backward(ys: List[Tensor], grads: List[Optional[Tensor]]) -> None:
    """Backward from ``ys`` with ``grads``; empties both lists, so only autograd holds them."""
    pairs = [(y, g) for y, g in zip(ys, grads) if y.requires_grad and g is not None]
    ys.clear()
    grads.clear()
    if pairs:
        root = _Seed.apply([g for _, g in pairs], *[y for y, _ in pairs])
        del pairs
        root.backward()


def _run(stage: Callable[..., Any], args: List[Any], popped: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
    """Stage outputs and stashes of one call with ``popped`` as the values it pops."""
    portals = _Recording()
    portals.values.update(popped)
    portals.io = StageIO([])
    previous = swap_portals(portals)
    try:
        out = stage(*args)
    finally:
        swap_portals(previous)
    return (list(out) if isinstance(out, tuple) else [out]), portals.io.stashed


def _leaf(value: Any, copy: Callable[[Tensor], bool] = lambda t: False) -> Any:
    """``value`` with its floating tensors detached as leaves that require grad (copied
    where ``copy`` says so)."""
    leaves, spec = flatten(value)
    out = []
    for x in leaves:
        if isinstance(x, Tensor):
            x = (x.detach().clone() if copy(x) else x.detach()).requires_grad_(x.is_floating_point() or x.is_complex())
        out.append(x)
    return unflatten(out, spec)


def prefix(xs: Sequence[int], p: int) -> int:
    """``x_{<=p}``: the sum over stages 0..p (0 for p < 0)."""
    return sum(xs[: p + 1]) if p >= 0 else 0


def floors(m: int, received: Sequence[int], saved: Sequence[int], phases: Sequence[Dict[str, int]],
           alone: Sequence[int]) -> Dict[str, Dict[str, Any]]:
    """The floor of each checkpoint mode for ``m`` micro-batches, with the phase that sets it
    (``phase``: the stage whose backward the last micro-batch runs; -1, its forward), what the
    other tasks hold then (``held_bytes``) and the last micro-batch's own peak (``last_bytes``)."""

    def best(terms: List[Tuple[int, int, int]]) -> Dict[str, Any]:
        phase, held, last = max(terms, key=lambda t: t[1] + t[2])
        return {"phase": phase, "held_bytes": held, "last_bytes": last, "floor_bytes": held + last}

    return {
        "never": best([(ph["held_stage"], (m - 1) * prefix(saved, ph["held_stage"]), ph["peak_bytes"])
                       for ph in phases]),
        "except_last": best([(ph["held_stage"], (m - 1) * prefix(received, ph["held_stage"]), ph["peak_bytes"])
                             for ph in phases]),
        "always": best([(p, m * prefix(received, p) - received[p], e) for p, e in enumerate(alone)]),
    }
