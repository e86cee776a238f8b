"""What a ``loss_fn`` keeps between calls, put back after the reading's fake calls, and named.

:class:`fxpipe.checks._loss_fn.LossFnReading` calls ``loss_fn`` on fake tensors (three batch
sizes) to read how it splits over micro-batches. A loss that keeps state -- a step counter
buffer for an annealed weight, a list it appends each loss to, a dict of running metrics --
changed it for real at each of those calls: a trial's counter moved 7 times a step (3 fake
calls, 4 micro-batches) instead of once (4.2e-2 to 8.3e-2 off), a logged list gained fake
tensors (``torch.stack(log).mean()`` returned one), and a metric summed into a dict made the
next reading fail with torch's bare ``DataDependentOutputException``.

:func:`kept` snapshots what the loss can reach, as :func:`fxpipe.checks._loss_keys.loss_key`
walks it (its closure, the globals its code names, a bound method's object, a callable object's
or criterion module's attributes, a ``functools.partial``'s arguments; three levels into
containers and plain objects), runs the block, and puts back each tensor whose version moved
and each list or dict whose contents changed, saying which. A loss whose tensors moved cannot be
called once per micro-batch (its state would move ``chunks`` times a step), so the reading
refuses to split it, and GPipe computes it once, on the merged output, as eager does. A list or
dict it only writes (a log) is put back and the loss split: its numbers are exact, and the log
holds an entry per micro-batch (the docs say so).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import Tensor

from ._loss_keys import DEPTH, function_reads

__all__ = ["kept", "Kept"]


class Kept:
    """What :func:`kept` found changed and put back, said (empty: nothing): ``state`` -- tensors
    changed in place, attributes given a number or an object (what the loss's value may read: a
    counter) -- and ``logs`` -- lists or dicts written, attributes given a tensor (``self.last =
    loss.detach()``: called per micro-batch, a log holds an entry per micro-batch, its numbers exact)."""

    def __init__(self) -> None:
        self.state: List[str] = []
        self.logs: List[str] = []


#: tensors up to this size are copied to be put back; a larger one changed in place is named only
_COPIED_BYTES = 1 << 20


def _reach(loss_fn: Any) -> Tuple[List[Tuple[str, Tensor]], List[Tuple[str, Any]], List[Tuple[str, dict]]]:
    """(named tensors, named lists and dicts, named attribute dicts) ``loss_fn`` can reach."""
    tensors: Dict[int, Tuple[str, Tensor]] = {}
    containers: Dict[int, Tuple[str, Any]] = {}
    attributes: Dict[int, Tuple[str, dict]] = {}

    def walk(name: str, x: Any, depth: int) -> None:
        if isinstance(x, Tensor):
            tensors.setdefault(id(x), (name, x))
            return
        if depth > DEPTH or x is None or isinstance(x, (bool, int, float, str, bytes, type)):
            return
        if isinstance(x, list):
            containers.setdefault(id(x), (name, x))
            for i, v in enumerate(x[:64]):
                walk(f"{name}[{i}]", v, depth + 1)
        elif isinstance(x, dict):
            containers.setdefault(id(x), (name, x))
            for k, v in list(x.items())[:64]:
                walk(f"{name}[{k!r}]", v, depth + 1)
        elif isinstance(x, tuple):
            for i, v in enumerate(x[:64]):
                walk(f"{name}[{i}]", v, depth + 1)
        elif isinstance(x, torch.nn.Module):
            for key, t in [*x.named_parameters(), *x.named_buffers()]:
                tensors.setdefault(id(t), (f"{name}.{key}", t))
            for sub_name, m in x.named_modules():
                label = f"{name}.{sub_name}".rstrip(".")
                attributes.setdefault(id(m), (label, m.__dict__))
                for k, v in vars(m).items():
                    if not k.startswith("_"):
                        walk(f"{label}.{k}", v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, type(functools)) and (depth == 0 or not callable(x)):
            attributes.setdefault(id(x), (name, vars(x)))
            for k, v in list(vars(x).items())[:64]:
                walk(f"{name}.{k}", v, depth + 1)

    fn = loss_fn
    if isinstance(fn, functools.partial):
        walk("loss_fn.args", fn.args, 0)
        walk("loss_fn.keywords", fn.keywords, 0)
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if isinstance(fn, torch.nn.Module) or (code is None and hasattr(fn, "__dict__")):
        walk("loss_fn", fn, 0)
    if owner is not None and (isinstance(owner, torch.nn.Module) or hasattr(owner, "__dict__")):  # not __slots__
        walk(type(owner).__name__, owner, 0)
    if code is not None:
        cells, names = function_reads(func)
        for name, value in cells + [(n, v) for n, v in names if not callable(v)]:
            walk(name, value, 0)
    return list(tensors.values()), list(containers.values()), list(attributes.values())


@contextmanager
def kept(loss_fn: Any) -> Iterator[Kept]:
    """Runs the block (calls of ``loss_fn`` on fake tensors), then puts back what it changed
    of the state ``loss_fn`` reaches (see the module docstring); yields what changed."""
    tensors, containers, attributes = _reach(loss_fn)
    # a loss that is a model's bound method reaches every weight: versions only for parameters
    # and large tensors (a 64 MiB buffer copied at each reading slowed the first steps 2-3x)
    saved_tensors = [(name, t, t._version, None if isinstance(t, torch.nn.Parameter)
                      or t.numel() * t.element_size() > _COPIED_BYTES else t.detach().clone())
                     for name, t in tensors]
    saved = [(name, c, list(c) if isinstance(c, list) else dict(c)) for name, c in containers]
    saved_attributes = [(name, d, dict(d)) for name, d in attributes]
    found = Kept()
    try:
        yield found
    finally:
        with torch.no_grad():
            for name, t, version, copy in saved_tensors:
                if t._version != version:
                    if copy is not None:
                        t.data.copy_(copy)
                    found.state.append(f"tensor '{name}'")
        for name, c, before in saved:
            if isinstance(c, list) and (len(c) != len(before) or any(a is not b for a, b in zip(c, before))):
                c[:] = before
                found.logs.append(f"list '{name}'")
            elif isinstance(c, dict) and (c.keys() != before.keys() or any(c[k] is not before[k] for k in before)):
                c.clear()
                c.update(before)
                found.logs.append(f"dict '{name}'")
        for name, attrs, before in saved_attributes:
            for key in [k for k in attrs if k not in before or attrs[k] is not before[k]]:
                value = attrs[key]
                if key in before:
                    attrs[key] = before[key]
                else:
                    del attrs[key]
                # a tensor kept (self.last = loss.detach()) is a log; a number or object, state
                logged = isinstance(value, Tensor) and (before.get(key) is None or isinstance(before.get(key), Tensor))
                (found.logs if logged else found.state).append(f"attribute '{name}.{key}'")
