"""The plain attributes a traced forward read: what a capture baked into its graph as constants.

torch.fx and torch.export run the model's Python once. Every attribute the traced code reads
that is not a tensor it computes with -- ``self.temperature``, ``self.num_heads``,
``self.config.use_cache``, a ``self.act = F.gelu`` function -- is used then and never again:
a number becomes a literal in the graph (``truediv(x, 1.0)``), a flag picks the branch that
was traced, a function is the op recorded. Setting ``model.temperature = 0.5`` after the build
changes nothing the pipeline runs. :class:`AttributeReads` records, while a capture traces,
which attributes of which objects the code read and what it got, so that
:mod:`fxpipe.capture._model_check` can refuse a call after one of them changed instead of silently
computing the old model.

How: for the duration of the trace, the classes of the model's modules (and of the plain
objects reached through their attributes, such as a transformers config) get a
``__getattribute__`` that notes each read on one of the watched objects, and a
``__setattr__`` that notes writes; both then do exactly what the class did before, and the
classes get their own methods back afterwards. What is recorded:

* a plain value (numbers, strings, ``None``, dtypes, devices, and tuples / lists / dicts /
  sets of them): compared by value at call time;
* any other object held in the instance's own ``__dict__`` (a function, a config, a tensor
  that is not a parameter or buffer): compared by identity; a config-like object is then
  watched too, so the reads of its own attributes are recorded;
* ``None`` read from a module's parameter, buffer or submodule registry (``bias=None``, an
  absent adapter): that it is still ``None``;
* a public name looked up on a module and found nowhere (``getattr(self, 'adapter', None)``,
  ``hasattr(self, 'gain')``): that it is still absent. An adapter or a gain set after the build
  was silently left out of every call (a trial).

Not recorded: the names ``nn.Module`` itself uses (``training`` -- a mode flip is the mode
checks' business (:mod:`fxpipe.capture._prepare`'s ``mode_sensitivity``) --, hook dicts,
``_compiled_call_impl``, ...), methods, parameters, buffers and submodules (the identity of
those is checked by :mod:`fxpipe.capture._model_check` from the graph itself), attributes the traced
code also wrote or changed in place (a forward keeping Python state such as a call counter:
its value is the forward's own, not the user's), and reads made inside a module kept opaque,
which runs its own code at each call.
"""

from __future__ import annotations

import copy
import enum
import functools
import threading
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Set, Tuple

import torch
from torch import fx, nn

from ._opaque_calls import OpaqueCalls
from ._values import same_plain

__all__ = ["AttrRead", "AttributeReads", "plain_attributes", "is_plain", "held_items", "same_items", "SAME", "EQUAL",
           "MUTABLE", "NONE", "ABSENT", "ITEMS", "REGISTRIES"]

# Names nn.Module itself defines or sets: never what a user's forward configures itself with.
_MODULE_OWN = frozenset(dir(nn.Module)) | frozenset(vars(nn.Module()))
_SCALARS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format, enum.Enum)
_CONTAINERS = (tuple, list, dict, set, frozenset)
_MAX_ITEMS = 256  # a bigger container is compared by identity (a vocabulary list, say)
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class written in Python (patchable)
_NOT_WATCHED = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
                torch.Tensor, nn.Module)

#: how a read is compared at call time
SAME, EQUAL, MUTABLE, NONE, ABSENT, ITEMS = "same", "equal", "mutable", "none", "absent", "items"
#: a value the traced code wrote and then read: compared by value, at what it holds when the
#: pipeline is made (the build's own eager runs may have written it again since the capture)
WRITTEN = "written"
_NO_VALUE = object()
#: where nn.Module keeps what its attributes resolve to besides ``__dict__``
REGISTRIES = ("_parameters", "_buffers", "_modules")


def is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a number, string, ``None``, dtype, device or enum, or a small
    container of those: a value a traced forward bakes into its graph, comparable by ``==``."""
    if isinstance(value, _SCALARS):
        return True
    if depth > 4 or not isinstance(value, _CONTAINERS) or len(value) > _MAX_ITEMS:
        return False
    if isinstance(value, dict):
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return all(is_plain(v, depth + 1) for v in value)


def _holds_mutable(value: Any) -> bool:
    if isinstance(value, (list, dict, set)):
        return True
    return isinstance(value, (tuple, frozenset)) and any(_holds_mutable(v) for v in value)


@dataclass
class AttrRead:
    """One attribute read by traced code.

    ``owner`` is the module or object read from, ``label`` names it as a message does
    (``'layers.0.attn.scale'``, ``'config.use_cache'``). ``value`` is what the read returned
    (for :data:`MUTABLE` a copy of it) and ``how`` how a later value is compared:
    :data:`EQUAL` by value, :data:`MUTABLE` by value against that copy, :data:`SAME` by
    identity, :data:`NONE` still ``None``. ``in_dict``: the value came from the owner's own
    ``__dict__`` (a call-time check can look there first).
    """

    owner: Any
    name: str
    value: Any
    how: str
    label: str
    in_dict: bool


def _watchable(value: Any) -> bool:
    """An object whose attribute reads can be recorded: an instance of a Python class with
    a ``__dict__`` (a config, a dataclass), not a function, class, tensor or module."""
    cls = type(value)
    return (bool(cls.__flags__ & _HEAPTYPE) and not isinstance(value, _NOT_WATCHED + _CONTAINERS)
            and isinstance(getattr(value, "__dict__", None), dict)
            and not str(cls.__module__).startswith(("torch.", "fxpipe.")))


class AttributeReads:
    """Records the attribute reads of traced code on ``model``'s modules (see the module
    docstring). Use as a context manager around one trace, then read :meth:`reads`. Only
    the entering thread's reads are recorded; sessions may overlap (two builds at once).

    ``opaque``: the calls of modules kept opaque whose code nevertheless runs while tracing
    (torch.export traces a leaf and then collapses it into one call), active around the same
    trace (:class:`~fxpipe.capture._opaque_calls.OpaqueCalls`): reads inside their calls are
    not recorded, since they run their own code again at every call.
    """

    def __init__(self, model: nn.Module, opaque: OpaqueCalls | None = None) -> None:
        self._labels: Dict[int, str] = {}
        self._objects: Dict[int, Any] = {}  # keeps what an id names alive for the session
        for name, m in model.named_modules(remove_duplicate=False):
            if id(m) not in self._labels:
                self._labels[id(m)] = name
                self._objects[id(m)] = m
        self._opaque = opaque if opaque is not None else OpaqueCalls()
        self._reads: Dict[Tuple[int, str], AttrRead] = {}
        self._written: Set[Tuple[int, str]] = set()
        self._reread: Set[Tuple[int, str]] = set()  # written, then read again (a branch on it)
        self._classes: List[type] = []
        self._busy = False
        self._thread = 0

    # -- session ----------------------------------------------------------------------------
    def __enter__(self) -> "AttributeReads":
        self._thread = threading.get_ident()
        with _lock:
            _sessions.append(self)
        for obj in list(self._objects.values()):
            self._watch_class(type(obj))
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _sessions.remove(self)
            for cls in reversed(self._classes):
                _unpatch(cls)
        self._classes = []

    def reads(self) -> List[AttrRead]:
        """The reads recorded, first read of each attribute, less those the code wrote: set
        anew, or a container it changed in place (``self.stats['calls'] += 1``). A plain value
        the code wrote on an object that is no module and read again after (a config:
        transformers' classifiers set ``config.problem_type`` at their first call, then branch
        on it; not a number, a counter calls move) is watched at the value it holds when the pipeline
        is made: the graph holds the branch it took for that value (a trial: switched to
        ``'regression'`` afterwards, 0.14 off)."""
        found = [r for key, r in self._reads.items()
                 if key not in self._written and not (r.how == MUTABLE and _changed(r))]
        for owner_id, name in self._reread:  # read again after the code wrote it: the graph follows it
            owner = self._objects.get(owner_id)
            if owner is None or isinstance(owner, nn.Module) or name.startswith("_"):
                continue
            value = getattr(owner, "__dict__", {}).get(name, _NO_VALUE)
            if value is None or isinstance(value, (str, bool)):  # a setting; a number is a counter, moved by calls
                found.append(AttrRead(owner, name, value, WRITTEN, self._label(owner, name), True))
        return found

    def written_numbers(self) -> List[str]:
        """The labels of the public attributes of modules where the traced code kept Python
        state, which a graph neither updates nor reads again, innermost first (the longest
        label): a number it set (``self.calls += 1``), a value it computed and stored
        (``self.aux_loss = ...``, a traced or fake tensor, or a container of them), a plain
        container it changed in place (``self.stats['calls'] += 1``), a container it put
        computed values in (``self.features.append(h)``)."""
        found = []
        for owner_id, name in self._written:
            owner = self._objects.get(owner_id)
            if not isinstance(owner, nn.Module) or name.startswith("_") or name in _MODULE_OWN:
                continue
            value = owner.__dict__.get(name)
            if isinstance(value, (int, float)) or _holds_traced(value):
                found.append(self._label(owner, name))
        for r in self._reads.values():
            if not isinstance(r.owner, nn.Module) or r.name.startswith("_") or r.label in found:
                continue
            if (r.how == MUTABLE and _changed(r)) or (r.how == SAME and _holds_traced(r.value)) \
                    or (r.how == ITEMS and _holds_traced(r.value[0])):
                found.append(r.label)
        return sorted(found, key=lambda label: (-label.count("."), label))

    def _watch_class(self, cls: type) -> None:
        if cls not in self._classes:
            with _lock:
                try:
                    _patch(cls)
                except (TypeError, AttributeError):  # a class that takes no attributes: not recorded
                    return
            self._classes.append(cls)

    def _mine(self, obj: Any) -> bool:
        return id(obj) in self._labels and not self._busy and threading.get_ident() == self._thread

    # -- recording --------------------------------------------------------------------------
    def _skipped(self, obj: Any, name: str) -> bool:
        return (name.startswith("__") or (isinstance(obj, nn.Module) and name in _MODULE_OWN)
                or self._opaque.inside or (id(obj), name) in self._reads or (id(obj), name) in self._written)

    def _label(self, obj: Any, name: str) -> str:
        owner = self._labels[id(obj)]
        return f"{owner}.{name}" if owner else name

    def _saw(self, obj: Any, name: str, value: Any) -> None:
        self._busy = True
        try:
            if (id(obj), name) in self._written:
                self._reread.add((id(obj), name))
            if self._skipped(obj, name) or isinstance(value, nn.Module):
                return
            attrs = object.__getattribute__(obj, "__dict__")
            in_dict = name in attrs and attrs[name] is value
            if is_plain(value):
                mutable = _holds_mutable(value)
                kept = copy.deepcopy(value) if mutable else value
                self._add(AttrRead(obj, name, kept, MUTABLE if mutable else EQUAL, self._label(obj, name), in_dict))
            elif in_dict and (items := held_items(value)) is not None:  # tensors, functions: the graph holds each
                self._add(AttrRead(obj, name, (value, items), ITEMS, self._label(obj, name), True))
            elif in_dict:  # a function, an object, a tensor that is no parameter or buffer
                label = self._label(obj, name)
                self._add(AttrRead(obj, name, value, SAME, label, True))
                if _watchable(value) and id(value) not in self._labels:
                    self._labels[id(value)] = label
                    self._objects[id(value)] = value
                    self._watch_class(type(value))
        except Exception:  # noqa: BLE001 - an object whose __dict__ cannot be read is not recorded
            pass
        finally:
            self._busy = False

    def _missing(self, obj: Any, name: str) -> None:
        """A read that falls through to ``nn.Module.__getattr__``: ``None`` in a registry is a
        value the traced code saw (the graph has no bias, no adapter)."""
        if not isinstance(obj, nn.Module):
            return
        self._busy = True
        try:
            if self._skipped(obj, name):
                return
            attrs = object.__getattribute__(obj, "__dict__")
            for registry in REGISTRIES:
                held = attrs.get(registry)
                if held is not None and name in held:
                    if held[name] is None:
                        self._add(AttrRead(obj, name, None, NONE, self._label(obj, name), False))
                    return
            if not name.startswith("_") and name not in attrs:  # found nowhere: absent when traced
                self._add(AttrRead(obj, name, None, ABSENT, self._label(obj, name), False))
        finally:
            self._busy = False

    def _add(self, read: AttrRead) -> None:
        self._reads[(id(read.owner), read.name)] = read


def plain_attributes(model: nn.Module, opaque: Iterable[nn.Module] = ()) -> List[AttrRead]:
    """Every plain attribute in the own ``__dict__`` of ``model``'s modules outside ``opaque``:
    what a capture *may* have read, for when its reads could not be recorded.

    torch.export traces the branches of ``torch.cond`` with dynamo, which cannot run the
    recording ``__getattribute__`` (it recurses); such a model is exported unrecorded and
    checked against this wider set instead: a change to any of these attributes is refused,
    also one the graph never read (a refusal to rebuild, never a silent difference).
    """
    skip: Set[int] = set()
    for m in opaque:
        skip.update(id(sub) for sub in m.modules())
    reads: Dict[Tuple[int, str], AttrRead] = {}
    for owner, m in model.named_modules(remove_duplicate=False):
        if id(m) in skip:
            continue
        for name, value in vars(m).items():
            if name.startswith("_") or name in _MODULE_OWN or (id(m), name) in reads or not is_plain(value):
                continue
            mutable = _holds_mutable(value)
            reads[(id(m), name)] = AttrRead(m, name, copy.deepcopy(value) if mutable else value,
                                            MUTABLE if mutable else EQUAL, f"{owner}.{name}" if owner else name, True)
    return list(reads.values())


def held_items(value: Any) -> Any:
    """A list, tuple or dict holding tensors or callables as ``((key, item), ...)``, each item by
    reference (``self.temps = [t]``: the graph holds ``t`` itself, and a new ``temps[0]`` would
    not reach it; ``self.acts = [torch.tanh]``: the graph holds the op it called), or a
    ``functools.partial``'s function, arguments and keywords (``keywords['negative_slope']``
    set in place); else None. A function put in such a container after the build was silently
    left out (a trial: 0.64 off)."""
    if isinstance(value, functools.partial):
        return (("func", value.func), *((("args", i), a) for i, a in enumerate(value.args)),
                *((("keywords", k), v) for k, v in value.keywords.items()))
    if isinstance(value, (list, tuple)):
        items = tuple(enumerate(value))
    elif isinstance(value, dict):
        items = tuple(value.items())
    else:
        return None
    return items if any(isinstance(v, torch.Tensor) or callable(v) for _, v in items) else None


def same_items(a: Any, b: Any) -> bool:
    """Whether two :func:`held_items` hold the same keys and the very same items (plain ones
    equal)."""
    return a is not None and b is not None and len(a) == len(b) and all(
        ka == kb and (va is vb or (is_plain(va) and is_plain(vb) and same_plain(va, vb)))
        for (ka, va), (kb, vb) in zip(a, b))


def _holds_traced(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is, or a list/tuple/dict of it holds, a value of a trace: an fx proxy,
    or a fake or functional tensor of torch.export (never a real tensor of the model's)."""
    if isinstance(value, fx.Proxy):
        return True
    if isinstance(value, torch.Tensor):
        return type(value).__name__ in ("FakeTensor", "FunctionalTensor")
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds_traced(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_holds_traced(v, depth + 1) for v in value.values())
    return False


def _changed(read: AttrRead) -> bool:
    try:
        now = getattr(read.owner, read.name)
    except Exception:  # noqa: BLE001 - gone
        return True
    return not same_plain(now, read.value)


# -- the patched classes, shared by the sessions running at a time ------------------------------
_lock = threading.RLock()
_sessions: List[AttributeReads] = []
_patched: Dict[type, Tuple[int, Dict[str, Any]]] = {}  # class -> (sessions using it, its own methods)


def _patch(cls: type) -> None:
    """Gives ``cls`` the recording ``__getattribute__``/``__setattr__`` (once, however many
    sessions use it); they call what ``cls`` resolved before, so behaviour is unchanged."""
    users, saved = _patched.get(cls, (0, {}))
    if users == 0:
        get = getattr(cls.__getattribute__, "_fxpipe_original", cls.__getattribute__)
        put = getattr(cls.__setattr__, "_fxpipe_original", cls.__setattr__)

        def __getattribute__(obj: Any, name: str) -> Any:
            try:
                value = get(obj, name)
            except AttributeError:
                for session in _sessions:
                    if session._mine(obj):
                        session._missing(obj, name)
                raise
            for session in _sessions:
                if session._mine(obj):
                    session._saw(obj, name, value)
            return value

        def __setattr__(obj: Any, name: str, value: Any) -> None:
            for session in _sessions:
                if id(obj) in session._labels and threading.get_ident() == session._thread:
                    session._written.add((id(obj), name))
            put(obj, name, value)

        __getattribute__._fxpipe_original = get  # type: ignore[attr-defined]
        __setattr__._fxpipe_original = put  # type: ignore[attr-defined]
        saved = {name: cls.__dict__.get(name) for name in ("__getattribute__", "__setattr__")}
        try:
            cls.__getattribute__ = __getattribute__  # type: ignore[method-assign]
            cls.__setattr__ = __setattr__  # type: ignore[method-assign]
        except (TypeError, AttributeError):
            _restore(cls, saved)
            raise
    _patched[cls] = (users + 1, saved)


def _unpatch(cls: type) -> None:
    users, saved = _patched[cls]
    if users > 1:
        _patched[cls] = (users - 1, saved)
        return
    del _patched[cls]
    _restore(cls, saved)


def _restore(cls: type, saved: Dict[str, Any]) -> None:
    for name, method in saved.items():
        if method is not None:
            setattr(cls, name, method)
        elif name in cls.__dict__:
            delattr(cls, name)
