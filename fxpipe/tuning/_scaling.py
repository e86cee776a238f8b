"""Recordings of other micro-batch sizes, derived instead of recorded, where shapes are linear.

A recorded forward (:mod:`fxpipe.tuning._nodes`) costs one run of the whole graph (0.7 s for
a 7B Llama on meta), and the tuner needs one per micro-batch size. In most models every
storage's bytes, every node's FLOPs and bytes moved are an affine function of the
micro-batch size ``b`` (``a + c * b``: activations scale with ``b``, a rotary table or a
causal mask does not), and which storages exist, who makes, reads and saves them, does not
depend on ``b`` at all. Then two recordings give every other size.

Nothing is assumed: :func:`fit` matches two recordings storage by storage (the same nodes,
the same storages in the same order of appearance, shared the same way) and refuses (None)
where they differ; :func:`derive` refuses where a derived byte count would not be a whole
non-negative number; and the caller derives the largest size it needs and compares it with a
third recording (:func:`same`) before trusting the fit for the sizes in between. Any refusal:
every size is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ._nodes import NodeRecord, Recording

__all__ = ["Fit", "fit", "derive", "same"]

_MAPS = ("makes", "reads", "saves", "grad_in", "grad_out", "grad_storage")
_NUMBERS = ("grad_params", "param_bytes", "flops", "moved", "scratch_forward", "scratch_backward")


@dataclass(frozen=True)
class Fit:
    """Two recordings of sizes ``s1 < s2``, matched: ``first``'s storage keys, ``other``
    maps each key of ``first`` to its bytes in the second."""

    first: Recording
    s1: int
    second: Recording
    s2: int
    other_bytes: Dict[int, int]
    other_outputs: Dict[int, int]


def _keys(rec: Recording) -> List[Tuple[int, int]]:
    """(key, bytes) of every storage mention, in a fixed order: node by node, map by map."""
    found: List[Tuple[int, int]] = []
    for node in rec.nodes:
        for name in _MAPS:
            found.extend(getattr(node, name).items())
    found.extend(rec.outputs.items())
    return found


def fit(a: Recording, s1: int, b: Recording, s2: int) -> Optional[Fit]:
    """Matches ``a`` (size ``s1``) and ``b`` (size ``s2 > s1``); None where they differ in
    anything but bytes and counts."""
    if [n.name for n in a.nodes] != [n.name for n in b.nodes] or s1 >= s2:
        return None
    for na, nb in zip(a.nodes, b.nodes):
        if any(len(getattr(na, m)) != len(getattr(nb, m)) for m in _MAPS):
            return None
    ka, kb = _keys(a), _keys(b)
    if len(ka) != len(kb) or len(a.outputs) != len(b.outputs):
        return None
    forward: Dict[int, int] = {}
    backward: Dict[int, int] = {}
    other: Dict[int, int] = {}
    for (key_a, _), (key_b, bytes_b) in zip(ka, kb):
        if forward.setdefault(key_a, key_b) != key_b or backward.setdefault(key_b, key_a) != key_a:
            return None  # shared differently: not the same structure
        if other.setdefault(key_a, bytes_b) != bytes_b:
            return None
    for na, nb in zip(a.nodes, b.nodes):
        if {forward[k]: forward[v] for k, v in na.grad_shared.items()} != nb.grad_shared:
            return None
    return Fit(a, s1, b, s2, other, {k: other[k] for k in a.outputs})


def _at(v1: float, v2: float, f: Fit, size: int, whole: bool) -> Optional[float]:
    num = (v2 - v1) * (size - f.s1)
    den = f.s2 - f.s1
    if whole:
        if num % den:
            return None
        value = v1 + num // den
        return None if value < 0 else value
    return v1 + num / den


def derive(f: Fit, size: int) -> Optional[Recording]:
    """The recording of micro-batch size ``size`` from the fit (same storage keys as
    ``f.first``); None where a byte count would not be a whole non-negative number."""
    nodes: List[NodeRecord] = []
    for na, nb in zip(f.first.nodes, f.second.nodes):
        made = NodeRecord(na.name)
        for m in _MAPS:
            out = {}
            for key, bytes_a in getattr(na, m).items():
                v = _at(bytes_a, f.other_bytes[key], f, size, True)
                if v is None:
                    return None
                out[key] = int(v)
            setattr(made, m, out)
        for name in _NUMBERS:
            whole = name != "flops"
            v = _at(getattr(na, name), getattr(nb, name), f, size, whole)
            if v is None:
                return None
            setattr(made, name, int(v) if whole else float(v))
        made.grad_shared = dict(na.grad_shared)  # keys, not bytes: the same at every size
        nodes.append(made)
    outputs = {}
    for key, bytes_a in f.first.outputs.items():
        v = _at(bytes_a, f.other_outputs[key], f, size, True)
        if v is None:
            return None
        outputs[key] = int(v)
    return Recording(nodes, outputs, set(f.first.external))


def same(a: Recording, b: Recording) -> bool:
    """Whether two recordings agree in structure and in every number (FLOPs to 1e-9)."""
    matched = fit(a, 0, b, 1)
    if matched is None:
        return False
    if any(bytes_a != matched.other_bytes[key] for key, bytes_a in _keys(a)):
        return False
    for na, nb in zip(a.nodes, b.nodes):
        for name in _NUMBERS:
            x, y = getattr(na, name), getattr(nb, name)
            if abs(x - y) > 1e-9 * max(abs(x), abs(y), 1.0):
                return False
    return True
