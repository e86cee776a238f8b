"""What crosses each stage boundary of the carried graph ``fxpipe.distributed`` runs
(:mod:`fxpipe.distributed._carry`), where a value read by a later stage crosses every stage
between: the bytes sent forward, those carried, the gradients sent back, those only passed on,
and what a zero-bubble input pass keeps of them. Measured on gloo ranks, used by
:mod:`fxpipe.tuning._memory` for torch's stages and by the simulator for send times.

:class:`Storages` indexes a :class:`~fxpipe.tuning._nodes.Recording` by storage: who makes,
reads and saves each one, by node position and stage (shared with
:mod:`fxpipe.tuning._activations`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence

from ._nodes import Recording

__all__ = ["Storages", "boundaries", "kept_input_grads"]


class Storages:
    """Who makes, reads and saves each storage, by node position and stage."""

    def __init__(self, rec: Recording, stage_of: Sequence[int]) -> None:
        self.bytes: Dict[int, int] = {}
        self.producer: Dict[int, int] = {}
        self.readers: Dict[int, List[int]] = {}
        self.savers: Dict[int, List[int]] = {}
        for i, node in enumerate(rec.nodes):
            for key, b in node.makes.items():
                self.bytes[key] = b
                self.producer.setdefault(key, i)
            for key, b in node.reads.items():
                self.bytes.setdefault(key, b)
                self.readers.setdefault(key, []).append(i)
            for key, b in node.saves.items():
                self.bytes[key] = max(b, self.bytes.get(key, 0))
                self.producer.setdefault(key, i)  # made and saved inside an opaque node
                self.savers.setdefault(key, []).append(i)
        self.stage_of = stage_of

    def spans(self) -> Iterator[tuple[int, int, int, int]]:
        """(storage, bytes, the stage making it, the last stage reading it) of every storage
        a node makes (parameters and the model's inputs are made by none)."""
        for key, nbytes in self.bytes.items():
            if key in self.producer:
                made = self.stage_of[self.producer[key]]
                yield key, nbytes, made, max((self.stage_of[r] for r in self.readers.get(key, [])), default=made)


def boundaries(rec: Recording, st: Storages, n_stages: int) -> List[tuple[int, int, int, int]]:
    """Per stage ``s``: (bytes crossing from ``s`` to ``s + 1``, those of them made before
    ``s``, bytes of the gradients of the values crossing into ``s``, those of them for values
    ``s`` only carries, without reading them): the boundaries of the carried graph
    ``fxpipe.distributed`` runs (:mod:`fxpipe.distributed._carry`), where a value read by a
    later stage crosses every stage between. Storages no node makes (parameters, the model's
    inputs) are left out, as in ``received``."""
    grad_bytes: Dict[int, int] = {}
    for node in rec.nodes:
        for key, b in node.grad_in.items():
            grad_bytes[key] = max(b, grad_bytes.get(key, 0))
    out, carried, grads, passed = ([0] * n_stages for _ in range(4))
    for key, nbytes, made, last in st.spans():
        reading = {st.stage_of[r] for r in st.readers.get(key, [])}
        for s in range(made, last):
            out[s] += nbytes
            carried[s] += nbytes if made < s else 0
            grads[s + 1] += grad_bytes.get(key, 0)
            if s + 1 < last and s + 1 not in reading:
                passed[s + 1] += grad_bytes.get(key, 0)
    return list(zip(out, carried, grads, passed))


def kept_input_grads(rec: Recording, st: Storages, n_stages: int) -> tuple[List[int], List[int]]:
    """Per stage, (the bytes its input gradients keep alive once sent, those of them in
    gradient storages of its own): see ``StageActivations.boundary_grads_kept`` and
    ``boundary_grads_storage``. A value read by one node of the stage and no later one gets
    that node's gradient, which may be a slice of a larger storage (the slices of a
    concatenation's gradient share it: counted once per node) -- of the stage's own when a
    node of the stage reads that node's output, else of the gradient that arrived for it (a
    receive buffer: nothing more); a slice is sent (or handed on) as a contiguous copy. A value
    read by several nodes, or read and carried on, gets a gradient of its own size; one only
    carried is left out (``boundary_grads_passed``)."""
    kept = [0] * n_stages
    storage: List[Dict[int, int]] = [{} for _ in range(n_stages)]  # reader node -> storage kept
    for key, _, made, last in st.spans():
        readers = st.readers.get(key, [])
        for s in range(made + 1, last + 1):
            here = [r for r in readers if st.stage_of[r] == s and key in rec.nodes[r].grad_in]
            if s == last and len(here) == 1:
                node = rec.nodes[here[0]]
                b = node.grad_in[key]
                whole = node.grad_storage.get(key, b)
                if whole > b and _output_read_in_stage(rec, st, here[0], s):
                    storage[s][here[0]] = max(whole, storage[s].get(here[0], 0))
                kept[s] += b
            elif here:  # a gradient of its own (a value only carried: boundary_grads_passed)
                kept[s] += max(rec.nodes[r].grad_in[key] for r in here)
    own = [sum(storage[s].values()) for s in range(n_stages)]
    return [k + o for k, o in zip(kept, own)], own


def _output_read_in_stage(rec: Recording, st: Storages, node: int, s: int) -> bool:
    """Whether a node of stage ``s`` reads an output of ``node``: then the gradient of that
    output is made in the stage, not received."""
    return any(st.stage_of[r] == s for key in rec.nodes[node].makes for r in st.readers.get(key, []))
