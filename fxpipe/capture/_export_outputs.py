"""Output objects torch.export refuses, taken apart and rebuilt: transformers caches.

transformers caches in the output (``past_key_values``: a ``DynamicCache`` when
``use_cache=True``, the default) are not pytree nodes, and torch.export refuses them.
Their key/value tensors are taken out as ordinary outputs (concatenated over micro-batches
like any output) and the cache object is rebuilt around them by the output spec
(:func:`compose_out_spec`), so the pipeline returns the same cache as eager. Caches holding
other tensors (static caches, sliding-window tensors, quantized caches), and any other
object holding tensors, are refused: see :func:`unsupported_output`.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["unsupported_output", "encoding_root", "compose_out_spec", "cache_base", "is_cache"]


def cache_base() -> type | None:
    """transformers' ``Cache`` class, or None when no model has imported it."""
    mod = sys.modules.get("transformers.cache_utils")  # a model returning one has imported it
    return getattr(mod, "Cache", None)


def is_cache(value: Any) -> bool:
    """A transformers cache (``DynamicCache``...): the object the capture takes apart."""
    base = cache_base()
    return base is not None and isinstance(value, base)


_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          torch.SymInt, torch.SymFloat, torch.SymBool, type, nn.Module)


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is or (a few levels down its attributes and containers) holds a tensor."""
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3 or isinstance(value, _PLAIN):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    attrs = getattr(value, "__dict__", None)
    return isinstance(attrs, dict) and any(
        _holds_tensor(v, depth + 1) for v in attrs.values())


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _plain_problem(name: str, value: Any) -> str:
    """Why an attribute cannot be kept in a template and copied into every rebuilt cache."""
    if _holds_tensor(value):
        return f"{name} holds tensors"
    leaves = pytree.tree_leaves(value)
    if any(isinstance(v, _SYMBOLIC) for v in leaves):
        return f"{name} depends on the batch size"
    try:
        copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - streams, handles: not a plain value
        return f"{name} ({type(value).__name__}) cannot be copied"
    return ""


class _CacheTemplate:
    """A cache's structure without its tensors: classes and plain attributes.

    Built from the object the model returned at capture time; :meth:`build` makes a new
    object of the same classes with the same plain attributes around new key/value tensors.
    Compared by identity (it is a TreeSpec context: one capture, one template).
    """

    def __init__(self, obj: Any) -> None:
        self.cls = type(obj)
        self.attrs: dict[str, Any] = {}
        self.layers: list[tuple[type, dict[str, Any], bool]] | None = None
        self.nested: dict[str, _CacheTemplate] = {}
        self.n_tensors = 0
        for name, value in vars(obj).items():
            if name == "layers" and isinstance(value, list):
                self.layers = []
                for i, layer in enumerate(value):
                    plain = {k: v for k, v in vars(layer).items() if k not in ("keys", "values")}
                    bad = [why for k, v in plain.items() for why in [_plain_problem(k, v)] if why]
                    if bad:
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds more than keys and values: "
                                           f"{'; '.join(bad)}")
                    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                    has_kv = isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
                    if not has_kv and (keys is not None or values is not None):
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds keys/values that are not tensors")
                    if has_kv and (keys.dim() == 0 or values.dim() == 0):
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds 0-dim keys/values")
                    self.layers.append((type(layer), plain, has_kv))
                    self.n_tensors += 2 if has_kv else 0
            elif is_cache(value):
                self.nested[name] = _CacheTemplate(value)
                self.n_tensors += self.nested[name].n_tensors
            elif _plain_problem(name, value):
                raise _Unsupported(f"attribute {_plain_problem(name, value)}")
            else:
                self.attrs[name] = value
        if self.layers is None and not self.nested:
            raise _Unsupported("structure is unknown (no cache layers, no nested caches)")

    def tensors(self, obj: Any) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for name, tpl in self.nested.items():
            out += tpl.tensors(getattr(obj, name))
        for (_, _, has_kv), layer in zip(self.layers or [], getattr(obj, "layers", [])):
            if has_kv:
                out += [layer.keys, layer.values]
        return out

    def build(self, tensors: Sequence[Any]) -> Any:
        it = iter(tensors)
        return self._build(it)

    def _build(self, it: Any) -> Any:
        obj = object.__new__(self.cls)
        obj.__dict__.update(copy.deepcopy(self.attrs))
        for name, tpl in self.nested.items():
            obj.__dict__[name] = tpl._build(it)
        if self.layers is not None:
            layers = []
            for cls, plain, has_kv in self.layers:
                layer = object.__new__(cls)
                layer.__dict__.update(copy.deepcopy(plain))
                layer.keys = layer.values = None
                if has_kv:
                    layer.keys, layer.values = next(it), next(it)
                    if "device" in plain:
                        layer.device = layer.keys.device
                    if "dtype" in plain:
                        layer.dtype = layer.keys.dtype
                layers.append(layer)
            obj.__dict__["layers"] = layers
        return obj

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({self.n_tensors} tensors)"


class _Unsupported(Exception):
    pass


class _CacheNode:
    """Pytree stand-in for a transformers cache in a model's output (private, never the user's type)."""

    __slots__ = ("template", "tensors")

    def __init__(self, template: _CacheTemplate, tensors: list[torch.Tensor]) -> None:
        self.template, self.tensors = template, tensors


pytree.register_pytree_node(
    _CacheNode,
    lambda n: (list(n.tensors), n.template),
    lambda values, template: template.build(list(values)),
    serialized_type_name="fxpipe.capture._export_outputs._CacheNode",
)


class _SizeNode:
    """Pytree stand-in for a ``torch.Size`` in a model's output: torch.export returns its
    numbers one by one, where ``fxpipe.tree`` keeps a Size whole (one leaf)."""

    __slots__ = ("values",)

    def __init__(self, values: list[Any]) -> None:
        self.values = values


pytree.register_pytree_node(
    _SizeNode,
    lambda n: (list(n.values), None),
    lambda values, _: torch.Size(values),
    serialized_type_name="fxpipe.capture._export_outputs._SizeNode",
)


def unsupported_output(value: Any) -> str:
    """Why an output leaf cannot be returned faithfully, or '' when it can.

    Tensors and plain values can; a transformers cache only through :class:`_CacheNode`
    (checked there); any other object holding tensors cannot: micro-batches would each
    produce one, and only the first micro-batch's could be returned.
    """
    if is_cache(value):
        try:
            _CacheTemplate(value)
        except _Unsupported as e:
            return f"a transformers {type(value).__name__} whose {e}"
        return ""
    if not isinstance(value, torch.Tensor) and _holds_tensor(value):
        return f"a {type(value).__module__}.{type(value).__qualname__} holding tensors"
    return ""


def _encode_leaves(leaves: Sequence[Any], record: dict[str, Any]) -> tuple[Any, ...]:
    """Output leaves with caches replaced by their tensors and sizes by their numbers; specs and
    problems go to ``record``."""
    out: list[Any] = []
    specs: list[pytree.TreeSpec | None] = []
    problems: list[str] = []
    for leaf in leaves:
        if is_cache(leaf):
            try:
                tpl = _CacheTemplate(leaf)
            except _Unsupported as e:
                problems.append(f"a transformers {type(leaf).__name__} whose {e}")
                out.append(leaf)
                specs.append(None)
                continue
            sub, spec = pytree.tree_flatten(_CacheNode(tpl, tpl.tensors(leaf)))
            out += sub
            specs.append(spec)
        elif isinstance(leaf, torch.Size):
            sub, spec = pytree.tree_flatten(_SizeNode(list(leaf)))
            out += sub
            specs.append(spec)
        else:
            why = unsupported_output(leaf)
            if why:
                problems.append(why)
            out.append(leaf)
            specs.append(None)
    record["specs"], record["problems"] = specs, problems
    return tuple(out)


def encoding_root(root: nn.Module, names: list[str], record: dict[str, Any]) -> nn.Module:
    """``root`` (same state, same argument names) whose output has caches taken apart."""
    base_forward = type(root).forward
    args = ", ".join(names)
    src = f"def forward(self, {args}):\n    return _fxpipe_encode(_fxpipe_base(self, {args}), _fxpipe_record)\n"
    ns: dict[str, Any] = {"_fxpipe_encode": _encode_leaves, "_fxpipe_base": base_forward, "_fxpipe_record": record}
    exec(compile(src, "<fxpipe-export-forward>", "exec"), ns)
    cls = type(type(root).__name__, (type(root),), {"forward": ns["forward"]})
    new = object.__new__(cls)
    new.__dict__.update(root.__dict__)  # the same _parameters/_buffers/_modules dicts
    return new


def compose_out_spec(spec: pytree.TreeSpec, leaf_specs: Sequence[pytree.TreeSpec | None]) -> pytree.TreeSpec:
    """``spec`` with leaf ``i`` replaced by ``leaf_specs[i]`` where that is not None."""
    if not any(s is not None for s in leaf_specs):
        return spec
    it = iter(leaf_specs)

    def walk(s: pytree.TreeSpec) -> pytree.TreeSpec:
        if s.is_leaf():
            new = next(it)
            return s if new is None else new
        return pytree.TreeSpec(s.type, s.context, [walk(c) for c in s.children()])

    return walk(spec)
