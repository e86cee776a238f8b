"""Per stage, what one micro-batch's activations cost: held between its forward and its
backward, and at the peak of its backward, with and without checkpointing.

From a :class:`~fxpipe.tuning._nodes.Recording` (one micro-batch's forward, storage by storage)
and a node -> stage assignment, each stage ``s`` gets (:class:`StageActivations`):

* ``held``: bytes one micro-batch keeps on the stage's device from ``F(s)`` to ``B(s)``.
  Not checkpointed: the storages its nodes saved for backward, each counted at the first stage
  of its memory pool that saves it (a tensor stage 2 saves and stage 3 saves too is held
  once when both share a device). Checkpointed: the storages it receives from earlier stages
  (arguments and popped portals), kept for the recomputation, each counted at the first
  stage of the pool that receives it. These are ``a_s`` and ``s_s`` of
  ``benchmarks/_floor.py``, predicted instead of measured.
* ``peak``: the most bytes of this micro-batch on the stage's device while ``B(s)`` runs,
  its own ``held`` included: walked node by node in reverse, each node allocating the
  gradients of its inputs (and a temporary of its parameters' size, accumulated into
  ``.grad``) and freeing the gradients of its outputs and the saved storages no earlier node
  of the pool still needs. Checkpointed, the recomputed forward comes first: the stage's own
  storages are made again (those nothing in the stage saves die after their last use).
* ``forward``: how far ``F(s)``'s own transient storages rise above what it leaves held.
* ``weight_held``: what a zero-bubble input pass (``I``) leaves for the weight pass (``W``):
  the storages saved by nodes with parameters, and the gradients of those nodes' outputs
  (``weight_grads``: torch's ``stage_backward_input`` keeps them too, with a pre-hook on each
  node where a parameter's gradient path meets the inputs').
* ``sent``, ``grads_in``: for torch's ``PipelineStage`` (``fxpipe.distributed``), which keeps
  a micro-batch's outputs until its backward and, between a zero-bubble input pass and its
  weight pass, the whole retained graph with the gradients that arrived
  (:func:`fxpipe.tuning._memory.activation_peaks`).

Inside one operation, what it allocates and frees for itself (a convolution's column
buffers, the contiguous copy of a gradient that arrives as a slice) is the node's measured
scratch (:mod:`fxpipe.tuning._scratch`): added on top of the bytes alive while that node runs,
forward (recomputation included) and backward. What this leaves out, on purpose: the
allocator's rounding, and gradients in flight between two tasks (a stage's input gradient
waits for the previous stage's backward; the schedule simulation counts them inside the next
task's ``peak``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Set

from ._boundaries import Storages, boundaries, kept_input_grads
from ._in_flight import in_flight
from ._nodes import Recording

__all__ = ["StageActivations", "stage_activations"]


@dataclass(frozen=True)
class StageActivations:
    """One micro-batch's activation bytes on stage ``s``'s device (see the module docstring).
    Index 0 of ``held`` / ``peak`` is not checkpointed, index 1 checkpointed."""

    held: tuple[int, int]
    peak: tuple[int, int]
    forward: int
    weight_held: int
    #: bytes this stage receives from earlier stages (all of them, for send times and buffers)
    received: int
    #: bytes of the model's outputs this stage returns (its last stage only)
    outputs: int
    #: bytes of the stage's outputs (sent on, or the model's) that ``held`` does not count on
    #: its device (not / checkpointed): a torch ``PipelineStage`` keeps them until its backward
    sent: tuple[int, int] = (0, 0)
    #: bytes of the gradients arriving for the stage's outputs (kept from a zero-bubble
    #: input pass to its weight pass)
    grads_in: int = 0
    #: (earlier stage of the same pool, bytes) of the gradients the stage's backward makes for
    #: what that stage sent it: they wait for that stage's backward (a skip's for long)
    grads_back: tuple[tuple[int, int], ...] = ()
    #: bytes of every value crossing from this stage to the next (``fxpipe.distributed``
    #: carries a skip through each stage it crosses): made here, and ``boundary_carried`` of
    #: them made before (a carry: a view of what the stage received)
    boundary_out: int = 0
    boundary_carried: int = 0
    #: bytes of the gradients this stage's backward sends to the previous stage (of every
    #: value crossing into it)
    boundary_grads: int = 0
    #: of those, the gradients of values the stage only carries (neither makes nor reads):
    #: passed on as they arrived, in the gradient receive buffer, nothing allocated
    boundary_grads_passed: int = 0
    #: what a zero-bubble input pass leaves of the gradients of the values it reads to the
    #: step's end: each input's ``.grad``, with the whole storage a slice keeps (a
    #: concatenation's gradient), and the contiguous copy of each slice that is sent
    boundary_grads_kept: int = 0
    #: of those, the gradient storages of the stage's own (not the copies): what a V's input
    #: pass adds when it hands its input gradients to the previous stage on the same rank,
    #: whose copies take the place of last step's
    boundary_grads_storage: int = 0
    #: bytes of the gradients of the outputs of the stage's nodes with parameters: what an input
    #: pass keeps for the weight pass, besides the saved storages
    weight_grads: int = 0
    #: the checkpointed backward's peak when the recomputed storages stay to its end
    #: (``fxpipe.distributed`` recomputes once for all the backward passes of a micro-batch,
    #: :mod:`fxpipe.distributed._recompute`); 0: not computed, use ``peak[1]``
    peak_shared: int = 0
    #: the most a zero-bubble weight pass rises above what its input pass left: each node with
    #: parameters, in order, allocates its measured backward scratch (a convolution's column
    #: buffers) and weight gradient, once the kept gradients of the nodes before it are freed
    #: (torch's ``stage_backward_weight`` frees each parameter group's as it goes); may be < 0
    weight_peak: int = 0
    #: how much higher the backward's peak (not / checkpointed) is when each parameter gradient
    #: stays from the node that makes it on: the stage's first backward under
    #: ``zero_grad='set_to_none'``, where that gradient becomes ``.grad`` instead of being
    #: added into an existing one (the gradients of the nodes already run are alive at its peak)
    grads_peak: tuple[int, int] = (0, 0)
    #: the largest parameter gradient of one of the stage's nodes: one autograd call summing
    #: two micro-batches' gradients of it holds three copies at once (the first, the second,
    #: their sum, made out of place; measured on torch 2.13), one more than the peak counts
    largest_grad: int = 0
    #: (not / checkpointed) ``(t, bytes)``: what this stage makes that is alive, held by no
    #: stage yet, from its forward to stage ``t``'s (:mod:`._in_flight`)
    in_flight: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = ((), ())

    @property
    def grads_made(self) -> int:
        """Bytes of the input gradients the stage's backward makes: those of the values
        crossing into it, less those it only passes on (``boundary_grads_passed``)."""
        return self.boundary_grads - self.boundary_grads_passed


def _first_per_pool(stages: Set[int], pool: Sequence[int]) -> List[int]:
    """The first stage of each pool among ``stages``."""
    first: Dict[int, int] = {}
    for s in sorted(stages):
        first.setdefault(pool[s], s)
    return list(first.values())


def stage_activations(rec: Recording, assignment: Mapping[str, int], n_stages: int,
                      pool: Sequence[int] | None = None, received_static: bool = False) -> List[StageActivations]:
    """Per stage, one micro-batch's :class:`StageActivations`. ``assignment`` maps node names
    to stages (a plan's), ``pool[s]`` says which memory pool (device) stage ``s`` is on:
    storages shared by stages of one pool are counted once (default: every stage its own).

    ``received_static``: what a stage receives from earlier stages lives in receive buffers
    allocated once, before the step (torch's ``PipelineStage``, ``fxpipe.distributed``): it is
    not held by the micro-batch, neither saved nor kept for a recomputation (the static bytes,
    :func:`fxpipe.tuning._memory.receive_buffers`, count it)."""
    pool = list(range(n_stages)) if pool is None else list(pool)
    stage_of = [int(assignment[r.name]) for r in rec.nodes]
    st = Storages(rec, stage_of)
    held_nc = [0] * n_stages
    held_ck = [0] * n_stages
    received = [0] * n_stages
    attributed_nc: Dict[int, Set[int]] = {}  # key -> stages holding it (not checkpointed)
    attributed_ck: Dict[int, Set[int]] = {}
    for key, nbytes in st.bytes.items():
        savers = {stage_of[i] for i in st.savers.get(key, [])}
        if received_static and key in st.producer:
            savers = {s for s in savers if s <= stage_of[st.producer[key]]}
        for s in _first_per_pool(savers, pool):
            held_nc[s] += nbytes
            attributed_nc.setdefault(key, set()).add(s)
        if key in st.producer:
            p = stage_of[st.producer[key]]
            later = {stage_of[i] for i in st.readers.get(key, []) if stage_of[i] > p}
            for s in later:
                received[s] += nbytes
            for s in () if received_static else _first_per_pool(later, pool):
                held_ck[s] += nbytes
                attributed_ck.setdefault(key, set()).add(s)
    outputs = [0] * n_stages
    for key, nbytes in rec.outputs.items():
        if key in st.producer:
            outputs[stage_of[st.producer[key]]] += nbytes
    result = []
    by_stage_nc: Dict[int, Set[int]] = {}
    by_stage_ck: Dict[int, Set[int]] = {}
    for key, ss in attributed_nc.items():
        for s in ss:
            by_stage_nc.setdefault(s, set()).add(key)
    for key, ss in attributed_ck.items():
        for s in ss:
            by_stage_ck.setdefault(s, set()).add(key)
    per_stage: List[List[int]] = [[] for _ in range(n_stages)]
    crossing = boundaries(rec, st, n_stages)
    flight = ([()] * n_stages, [()] * n_stages) if received_static else (
        in_flight(st, pool, n_stages, attributed_nc), in_flight(st, pool, n_stages, attributed_ck))
    grads_kept, grads_storage = kept_input_grads(rec, st, n_stages)
    for i, s in enumerate(stage_of):
        per_stage[s].append(i)
    for s in range(n_stages):
        nodes = per_stage[s]
        mine_nc = by_stage_nc.get(s, set())
        mine_ck = by_stage_ck.get(s, set())
        incoming = _incoming_grads(rec, st, nodes, s, received_static)
        arriving = sum(incoming.values())
        # torch's stages keep a micro-batch's outputs (fwd_cache) through its whole backward
        outputs_kept = _sent(rec, st, nodes, s) if received_static else set()
        peak_nc = _backward_peak(rec, st, nodes, mine_nc, incoming, kept=outputs_kept)
        recompute_peak, alive = _recompute(rec, st, nodes, s, mine_ck)
        peak_ck = max(recompute_peak + arriving, _backward_peak(rec, st, nodes, alive, incoming))
        peak_shared = max(recompute_peak + arriving, _backward_peak(rec, st, nodes, alive, incoming, keep_saved=True))
        made_nc = _backward_peak(rec, st, nodes, mine_nc, incoming, kept=outputs_kept, grads_stay=True)
        made_ck = max(recompute_peak + arriving, _backward_peak(rec, st, nodes, alive, incoming, grads_stay=True))
        sent = [0, 0]
        for key in _sent(rec, st, nodes, s):
            for ck, attributed in enumerate((attributed_nc, attributed_ck)):
                if not any(pool[t] == pool[s] for t in attributed.get(key, ())):
                    sent[ck] += st.bytes[key]
        result.append(StageActivations(
            (held_nc[s], held_ck[s]), (peak_nc, peak_ck), _forward_extra(rec, st, nodes, s, held_nc[s]),
            _weight_held(rec, st, nodes, mine_nc), received[s], outputs[s], (sent[0], sent[1]),
            arriving, _grads_back(rec, st, nodes, s, pool), *crossing[s],
            boundary_grads_kept=grads_kept[s], boundary_grads_storage=grads_storage[s],
            weight_grads=sum(_weight_grads(rec, nodes).values()), peak_shared=peak_shared,
            weight_peak=_weight_pass_peak(rec, nodes), grads_peak=(made_nc - peak_nc, made_ck - peak_ck),
            largest_grad=max((rec.nodes[i].grad_params for i in nodes), default=0),
            in_flight=(flight[0][s], flight[1][s])))
    return result


def _grads_back(rec: Recording, st: Storages, nodes: List[int], s: int,
                pool: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per earlier stage on the stage's device, the bytes of the gradients this stage's
    backward makes for the storages that stage produced (one per storage; the storage a
    gradient keeps alive, where the recording saw a larger one). Gradients one node makes as
    one storage (``grad_shared``: a concatenation's slices for a skip from stage 0 and a value
    from stage 1) are that storage once, waiting for the earliest of those stages: its
    backward, the last of them, frees it (counted at each, the U-Net-like model's 1 MiB
    concatenation gradient made GPipe's predicted peak 10% high)."""
    found: Dict[int, int] = {}
    for i in nodes:
        node = rec.nodes[i]
        groups: Dict[int, List[int]] = {}
        for key in node.grad_in:
            p = st.stage_of[st.producer[key]] if key in st.producer else s
            if p < s and pool[p] == pool[s]:
                groups.setdefault(node.grad_shared.get(key, key), []).append(key)
        for keys in groups.values():
            last_freed = min(keys, key=lambda k: st.stage_of[st.producer[k]])
            whole = max(node.grad_storage.get(k, node.grad_in[k]) for k in keys)  # a view keeps it all
            for key in keys:
                found[key] = max(found.get(key, 0), whole if key == last_freed else 0)
    per: Dict[int, int] = {}
    for key, b in found.items():
        if b:
            p = st.stage_of[st.producer[key]]
            per[p] = per.get(p, 0) + b
    return tuple(sorted(per.items()))


def _incoming_grads(rec: Recording, st: Storages, nodes: List[int], s: int,
                    received_static: bool = False) -> Dict[int, int]:
    """Gradients arriving for the stage's outputs: values later stages read, and the model's
    (the loss's gradient). ``received_static``: those from later stages arrive in gradient
    receive buffers allocated before the step: they flow, at 0 bytes."""
    grads: Dict[int, int] = {}
    for i in nodes:
        for key, b in rec.nodes[i].grad_out.items():
            if key in rec.outputs:
                grads[key] = b
            elif any(st.stage_of[r] > s for r in st.readers.get(key, [])):
                grads[key] = 0 if received_static else b
    return grads


def _sent(rec: Recording, st: Storages, nodes: List[int], s: int) -> Set[int]:
    """Storages the stage makes that later stages read, or that the model returns."""
    mine = set(nodes)
    return {key for key, p in st.producer.items() if p in mine and (
        key in rec.outputs or any(st.stage_of[r] > s for r in st.readers.get(key, [])))}


def _backward_peak(rec: Recording, st: Storages, nodes: List[int], saved: Set[int],
                   incoming: Dict[int, int], keep_saved: bool = False, kept: Set[int] = frozenset(),
                   grads_stay: bool = False) -> int:
    """Peak bytes while the stage's nodes run backward in reverse, from ``saved`` (storages
    held for it, freed after the last node needing them, or never with ``keep_saved``; those
    in ``kept`` never either) and the ``incoming`` gradients. Each node's parameter gradients
    are a temporary (added into ``.grad``), or with ``grads_stay`` stay to the end (they
    become ``.grad``)."""
    alive: Dict[int, int] = {k: st.bytes[k] for k in saved}
    grads: Dict[int, int] = dict(incoming)
    current = sum(alive.values()) + sum(grads.values())
    peak = current
    # a saved storage is freed once the earliest of the stage's nodes saving it has run backward
    free_at: Dict[int, List[int]] = {}
    node_set = set(nodes)
    for key in () if keep_saved else saved - kept:
        mine = [i for i in st.savers.get(key, []) if i in node_set]
        if mine:
            free_at.setdefault(min(mine), []).append(key)
    for i in reversed(nodes):
        node = rec.nodes[i]
        flows = any(k in grads for k in node.grad_out)
        temp = 0
        if flows:
            for key, b in node.grad_in.items():
                if key in grads:
                    temp += b  # a second contribution: made, then added into the first
                else:
                    grads[key] = b
                    current += b
            if grads_stay:
                current += node.grad_params
            else:
                temp += node.grad_params
            peak = max(peak, current + temp + node.scratch_backward)
            for key in node.grad_out:
                current -= grads.pop(key, 0)
        for key in free_at.get(i, []):
            current -= alive.pop(key, 0)
    return peak


def _recompute(rec: Recording, st: Storages, nodes: List[int], s: int, received: Set[int]) -> tuple[int, Set[int]]:
    """A checkpointed stage's recomputed forward: (its peak, the storages alive after it:
    the received ones and everything the stage's nodes saved)."""
    node_set = set(nodes)

    def dies_after(key: int, producer: int) -> int | None:
        if any(j in node_set for j in st.savers.get(key, [])):
            return None  # saved by the stage: kept for its backward
        return max((j for j in st.readers.get(key, []) if j in node_set), default=producer)

    return _walk_forward(rec, st, nodes, {k: st.bytes[k] for k in received}, dies_after)


def _walk_forward(rec: Recording, st: Storages, nodes: List[int], alive: Dict[int, int],
                  dies_after: Callable[[int, int], int | None]) -> tuple[int, Set[int]]:
    """The stage's nodes run forward from ``alive``: each makes its storages, each storage
    freed after node ``dies_after(key, producer)`` (None: kept). (peak, alive at the end)."""
    current = sum(alive.values())
    peak = current
    free_at: Dict[int, List[int]] = {}
    for i in nodes:
        for key in (*rec.nodes[i].makes, *rec.nodes[i].saves):
            if key not in alive and st.producer.get(key) == i:
                alive[key] = st.bytes[key]
                current += st.bytes[key]
                last = dies_after(key, i)
                if last is not None:
                    free_at.setdefault(max(last, i), []).append(key)
        peak = max(peak, current + rec.nodes[i].scratch_forward)
        for key in free_at.pop(i, []):
            current -= alive.pop(key, 0)
    return peak, set(alive)


def _forward_extra(rec: Recording, st: Storages, nodes: List[int], s: int, held: int) -> int:
    """How far the stage's forward rises above what it leaves held (its transient outputs)."""
    node_set = set(nodes)

    def dies_after(key: int, producer: int) -> int | None:
        readers = st.readers.get(key, [])
        if st.savers.get(key) or key in rec.outputs or any(st.stage_of[r] > s for r in readers):
            return None
        return max((j for j in readers if j in node_set), default=producer)

    peak, alive = _walk_forward(rec, st, nodes, {}, dies_after)
    current = sum(st.bytes[k] for k in alive)
    return max(0, peak - max(current, held))


def _weight_held(rec: Recording, st: Storages, nodes: List[int], saved: Set[int]) -> int:
    """What an input-gradient pass leaves for the weight pass: storages saved by nodes with
    parameters, and the gradients of those nodes' outputs."""
    with_params = [i for i in nodes if rec.nodes[i].grad_params]
    keep = {k for i in with_params for k in rec.nodes[i].saves if k in saved}
    return sum(st.bytes[k] for k in keep) + sum(_weight_grads(rec, nodes).values())


def _weight_pass_peak(rec: Recording, nodes: List[int]) -> int:
    """See ``StageActivations.weight_peak``: the parameter groups run in the order of the
    stage's parameters, that is of its nodes."""
    peak, freed, seen = None, 0, set()
    for i in nodes:
        node = rec.nodes[i]
        if not node.grad_params:
            continue
        here = node.scratch_backward + node.grad_params - freed
        peak = here if peak is None else max(peak, here)
        for key, b in node.grad_out.items():
            if key not in seen:
                seen.add(key)
                freed += b
    return peak or 0


def _weight_grads(rec: Recording, nodes: List[int]) -> Dict[int, int]:
    """The gradients of the outputs of the nodes with parameters, by output storage."""
    return {k: b for i in nodes if rec.nodes[i].grad_params for k, b in rec.nodes[i].grad_out.items()}
