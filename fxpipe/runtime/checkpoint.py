"""Checkpointing with a separate recomputation step (torchgpipe §3.2.1).

``torch.utils.checkpoint`` recomputes inside the backward of the checkpointed region, so
recomputation cannot start before the whole incoming gradient has arrived. Here the work is
split into two autograd functions that share memory through a deque:

* ``Checkpoint`` runs the partition without keeping activations and, in backward, only
  consumes what ``Recompute`` left behind;
* ``Recompute`` is attached (via Fork/Join) to the *output* side, so its backward -- the
  recomputation -- is scheduled as soon as the output's gradient is being produced, which
  lets it overlap the gradient copy from the next device.

On CPU-only pipelines there is no copy to overlap, so ``Checkpointing(fused=True)`` skips
the Recompute/Fork/Join detour and recomputes inside ``Checkpoint``'s backward: three
fewer autograd functions per task, same results.

RNG states are saved before the first run and restored for the recomputation, so dropout
recomputes bit-exactly; so are the autocast state (the recomputation usually runs in
backward, outside the user's ``torch.autocast`` block) and the buffers the partition updates
in forward (see ``_state_swapped``). Outputs that cannot need grad (masks, integer tensors) are marked
non-differentiable and skipped in backward, which torchgpipe 0.0.7 gets wrong.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Deque, Generator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .autocast import AutocastState, autocast_state
from .autocast import entered as entered_autocast
from .dependency import fork, join

try:  # private but long-standing: what torch.autograd.backward itself calls
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - other torch versions
    _engine_run_backward = None
from ..errors import CheckpointBackwardError
from ..tree import flatten_values, unflatten_values
from .microbatch import Batch
from .phony import get_phony

__all__ = ["is_checkpointing", "is_recomputing", "Checkpointing", "Checkpoint", "Recompute"]

RNGStates = Tuple[Tensor, Optional[Tensor]]


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


_local = _ThreadLocal()


@contextmanager
def _raised(flag: str) -> Generator[None, None, None]:
    """Sets one of this thread's flags for the block, restoring it afterwards."""
    orig = getattr(_local, flag)
    setattr(_local, flag, True)
    try:
        yield
    finally:
        setattr(_local, flag, orig)


def enable_checkpointing() -> ContextManager[None]:
    return _raised("is_checkpointing")


def enable_recomputing() -> ContextManager[None]:
    return _raised("is_recomputing")


def is_checkpointing() -> bool:
    """True while the current forward runs under checkpointing (the first, activation-free pass)."""
    return _local.is_checkpointing


def is_recomputing() -> bool:
    """True while the current forward is a recomputation; use it to skip repeated side effects."""
    return _local.is_recomputing


def save_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> None:
    cpu_state = torch.get_rng_state()
    gpu_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    rng_states.append((cpu_state, gpu_state))


@contextmanager
def restore_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> Generator[None, None, None]:
    """Runs the block with the saved RNG states, leaving the callers' RNG states unchanged.

    The states stay saved (read, not popped): a second backward through the same graph
    (``retain_graph=True``) recomputes again, with the same dropout masks."""
    cpu_state, gpu_state = rng_states[-1]
    if gpu_state is None:
        # CPU only: a plain save/set/restore (fork_rng's generality costs ~10 us a task).
        outer = torch.get_rng_state()
        torch.set_rng_state(cpu_state)
        try:
            yield
        finally:
            torch.set_rng_state(outer)
        return
    with torch.random.fork_rng([device]):
        torch.set_rng_state(cpu_state)
        torch.cuda.set_rng_state(gpu_state, device)
        yield


# A batch is passed through autograd functions as (template, *tensors): the template keeps
# the non-tensor values and where the tensors go.
_TENSOR = object()


Template = Tuple[bool, Any, List[Any], bool]  # atomic, pytree spec, leaves, has carry


def _split(batch: Batch) -> Tuple[Template, List[Tensor]]:
    leaves, spec = flatten_values(batch.values)
    template = [_TENSOR if isinstance(v, Tensor) else v for v in leaves]
    tensors = [v for v in leaves if isinstance(v, Tensor)]
    if batch.carry is not None:
        tensors.append(batch.carry)
    return (batch.atomic, spec, template, batch.carry is not None), tensors


def _rebuild(template: Template, tensors: Sequence[Tensor]) -> Batch:
    atomic, spec, leaves, has_carry = template
    it = iter(tensors)
    values = unflatten_values([next(it) if v is _TENSOR else v for v in leaves], spec)
    batch = Batch(values[0] if atomic else tuple(values), atomic=atomic)
    if has_carry:
        batch.carry = next(it)
    return batch


def _differentiable(x: Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


Function = Callable[[Batch], Batch]


#: One piece of mutable module state: (module, "_buffers" or "_parameters", key).
StateSlot = Tuple[torch.nn.Module, str, str]


@contextmanager
def _state_swapped(slots: Sequence[StateSlot], snapshot: Sequence[Tensor]) -> Generator[None, None, None]:
    """Runs the block with each slot holding its snapshot instead of the live tensor.

    The recomputation of a stage that updates a buffer in forward (running statistics, a
    counter) must see the buffer as the first pass saw it, not as later micro-batches left
    it, and must not apply its update a second time. Swapping the *object* (not copying
    data into the live buffer) keeps the live buffer's version counter untouched, so
    nothing saved for backward is invalidated, and the recomputation's own update lands on
    the snapshot, which is dropped.
    """
    live = []
    for (module, where, key), saved in zip(slots, snapshot):
        table = module.__dict__[where]
        live.append(table[key])
        table[key] = saved
    try:
        yield
    finally:
        for (module, where, key), tensor in zip(slots, live):
            module.__dict__[where][key] = tensor


class Checkpointing:
    """Checkpoint and recompute one (micro-batch, partition) task.

    ``state`` lists the buffers the partition updates in forward; they are snapshotted
    before the first pass and swapped in for the recomputation (see ``_state_swapped``).
    """

    def __init__(self, function: Function, batch: Batch, device: torch.device, *, fused: bool = False,
                 state: Sequence[StateSlot] = (), anchor_carries: bool = True) -> None:
        self.function = function
        self.batch: Optional[Batch] = batch  # until recompute(): see there
        self.device = device
        self.fused = fused
        self.state = state
        self.anchor_carries = anchor_carries
        self.snapshot: List[Tensor] = []
        self.autocast: AutocastState = autocast_state()
        # Shared between Checkpoint and Recompute; one entry at a time.
        self.recomputed: Deque[Tuple[List[Tensor], Tuple[Tensor, ...]]] = deque(maxlen=1)
        self.rng_states: Deque[RNGStates] = deque(maxlen=1)
        self.out_template: Deque[Template] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Runs the partition without keeping its activations."""
        template, tensors = _split(self.batch)
        phony = get_phony(self.device, requires_grad=True)
        outputs = Checkpoint.apply(phony, self, template, *tensors)
        return _rebuild(self.out_template.pop(), outputs)

    def recompute(self, batch: Batch) -> None:
        """Attaches the recomputation to ``batch``, the checkpointed output, in place.

        Also lets go of the input batch: from here on Checkpoint and Recompute hold their
        inputs as saved tensors, which their backward frees, whereas this object lives as
        long as the whole graph (``ctx.chk``), i.e. until the step's backward ends; keeping
        the batch here would keep every checkpointed task's inputs until then.
        """
        inputs, self.batch = self.batch, None
        if self.fused:
            return  # Checkpoint's backward recomputes by itself.
        anchor = batch.anchor()
        target = batch[anchor] if anchor is not None else batch.carry
        if target is None or not target.requires_grad:
            return
        template, tensors = _split(inputs)
        target, phony = fork(target)
        phony = Recompute.apply(phony, self, template, *tensors)
        target = join(target, phony)
        if anchor is not None:
            batch[anchor] = target
        else:
            batch.carry = target


def _run_backward(outputs: List[Tensor], grads: List[Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)`` without its argument normalisation.

    The grads come straight from autograd, shaped and defined; skipping the checks saves
    about 35 us per checkpointed task. Falls back to the public call if torch moves it.
    """
    if _engine_run_backward is None:
        torch.autograd.backward(outputs, grads)
        return
    _engine_run_backward(tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _phony_carriers(batch: Batch, tensors: Sequence[Tensor], anchor_carries: bool) -> Tuple[int, ...]:
    """Indices, among a batch's tensors, of those that carry phony joins made inside the
    partition: its carry, and its anchor when ``anchor_carries`` (``@skippable`` layers
    join their stashes to it; generated stage code puts them on the carry)."""
    anchor = batch.anchor() if anchor_carries else None
    carriers = [next((i for i, t in enumerate(tensors) if t is batch[anchor]), -1) if anchor is not None else -1]
    if batch.carry is not None:
        carriers.append(len(tensors) - 1)
    return tuple(carriers)


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phony: Tensor, chk: Checkpointing, template: Any, *tensors: Tensor):  # type: ignore[override]
        ctx.chk = chk
        ctx.template = template
        save_rng_states(chk.device, chk.rng_states)
        if chk.state:
            chk.snapshot = [module.__dict__[where][key].detach().clone() for module, where, key in chk.state]
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), enable_checkpointing():
            output = chk.function(_rebuild(template, tensors))
        out_template, out_tensors = _split(output)
        # A parameter the stage returns as is (``return ..., self.a.weight``) must not
        # become this Function's output: autograd would give the Parameter itself this
        # node as its grad_fn. A detached alias is returned instead; backward reaches the
        # parameter through the recomputed output, which is the parameter again.
        inputs = {id(t) for t in tensors}
        out_tensors = [y.detach() if y.requires_grad and id(y) not in inputs else y for y in out_tensors]
        chk.out_template.append(out_template)
        ctx.mark_non_differentiable(*[y for y in out_tensors if not _differentiable(y)])
        # Outputs that get no gradient stay without one (as in eager, a parameter feeding
        # only an unused output keeps grad None). The two that carry the pipeline's phony
        # joins (the anchor and the carry) are visited in backward all the same, without a
        # gradient (see _visit): their joins deliver portal gradients.
        ctx.set_materialize_grads(False)
        ctx.always = _phony_carriers(output, out_tensors, chk.anchor_carries)
        return tuple(out_tensors)

    @staticmethod
    def backward(ctx, *grad_output: Optional[Tensor]):  # type: ignore[override]
        _check_backward()
        if not ctx.chk.recomputed:  # fused: no Recompute ran ahead of us
            _recompute(ctx.chk, ctx.template, ctx.saved_tensors)
        outputs, input_leaves = ctx.chk.recomputed.pop()
        pairs = [(y, g) for y, g in zip(outputs, grad_output) if y.requires_grad and g is not None]
        pairs += [_visit(y) for i, (y, g) in enumerate(zip(outputs, grad_output))
                  if g is None and i in ctx.always and y.requires_grad]
        if pairs:
            _run_backward([y for y, _ in pairs], [g for _, g in pairs])
        grads = tuple(x.grad if x.requires_grad else None for x in input_leaves)
        return (None, None, None) + grads


def _check_backward() -> None:
    """Refuses the backwards a checkpointed stage would silently get wrong.

    The recomputed stage is differentiated by a nested backward that accumulates into
    ``.grad`` and records no graph. ``torch.autograd.grad`` and ``backward(inputs=...)``
    would not see those gradients (torch's own reentrant checkpoint refuses them the same
    way), and a double backward (``create_graph=True``: grad mode is on in backward) would
    miss every second-order term.
    """
    if not torch.autograd._is_checkpoint_valid():
        what = "torch.autograd.grad(...) or .backward(inputs=...)"
    elif torch.is_grad_enabled():
        what = "a backward with create_graph=True (double backward, e.g. a gradient penalty)"
    else:
        return
    raise CheckpointBackwardError(
        f"{what} through a checkpointed pipeline stage: the recomputation accumulates its "
        "gradients into .grad with a backward of its own, which this call cannot see, so the "
        "result would be wrong. Build the pipeline with checkpoint='never' for this, or call "
        "loss.backward() and read .grad."
    )


class _BackwardGuard(torch.autograd.Function):
    """A phony with an edge to each parameter, whose backward runs ``_check_backward``.

    Joined to the pipeline's outputs, it lies on every path from a loss to a parameter.
    ``torch.autograd.grad(loss, params)`` would otherwise skip the checkpointed stages
    altogether (no edge leads from them to the parameters: their gradients come from the
    nested backward) and answer without them. Its own gradients are None, and it runs at
    the start of backward, so it does not delay (or reorder) any accumulation.
    """

    @staticmethod
    def forward(ctx, device: torch.device, *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.n = len(params)
        ctx.set_materialize_grads(False)
        return get_phony(device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]) -> Tuple[None, ...]:  # type: ignore[override]
        _check_backward()
        return (None,) * (ctx.n + 1)


def guard_backward(values: Sequence[Any], params: Sequence[Tensor]) -> List[Any]:
    """``values`` (a pipeline's output leaves), joined to a :class:`_BackwardGuard` over
    ``params`` where they need grad: call it when some micro-batch was checkpointed."""
    params = [p for p in params if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return list(values)
    guard = _BackwardGuard.apply(params[0].device, *params)  # one, shared by every output
    return [join(v, guard) if isinstance(v, Tensor) and v.requires_grad else v for v in values]


class _NoGradient(torch.autograd.Function):
    """A phony computed from ``x`` whose backward sends ``x`` no gradient (``None``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return get_phony(x.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]) -> None:  # type: ignore[override]
        return None


def _visit(y: Tensor) -> Tuple[Tensor, Tensor]:
    """A backward root, with its gradient, that visits ``y``'s graph without a gradient.

    Backward runs every node reachable from its roots, also those no gradient reaches; the
    phony joins on a stage's anchor and carry (portals' PortalBlue) must run so, to hand
    the stashed values their gradients. A zero gradient for ``y`` would visit them too,
    but would also reach the parameters behind ``y`` as zeros where eager leaves their
    grads None.
    """
    with torch.enable_grad():  # Checkpoint.backward runs without grad mode
        root = _NoGradient.apply(y)
    return root, torch.empty_like(root)


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phony: Tensor, chk: Checkpointing, template: Any, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.chk = chk
        ctx.template = template
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        return phony.detach()

    @staticmethod
    def backward(ctx, *grad_output: Tensor):  # type: ignore[override]
        tensors = ctx.saved_tensors
        _recompute(ctx.chk, ctx.template, tensors)
        return (None, None, None) + tuple(None for _ in tensors)


def _recompute(chk: Checkpointing, template: Any, tensors: Sequence[Tensor]) -> None:
    """Runs the partition again, with the saved RNG states, recording its graph this time."""
    leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in tensors)
    # A fresh copy of the snapshot each time: a second backward (retain_graph=True)
    # recomputes again and must see the buffers as the first pass saw them.
    snapshot = [s.clone() for s in chk.snapshot]
    with restore_rng_states(chk.device, chk.rng_states), _state_swapped(chk.state, snapshot):
        with torch.enable_grad(), enable_recomputing(), entered_autocast(chk.autocast):
            output = chk.function(_rebuild(template, leaves))
    _, out_tensors = _split(output)
    chk.recomputed.append((out_tensors, leaves))
