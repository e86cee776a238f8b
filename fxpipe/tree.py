"""The one way fxpipe takes structured values apart and puts them back together.

Values cross stages, checkpoints, copies and portals as whatever the model produced: a
tensor, a tuple from ``split``, a dict, a transformers ``ModelOutput``, a registered or
plain dataclass, a namedtuple. Every place that must find the tensors inside such a value
(Checkpoint/Recompute, Copy/Wait, portals, scatter/gather of model outputs) flattens it here,
so a container type known to one of them is known to all. A container seen by one mechanism
and missed by another is how gradients get lost silently.

``torch.utils._pytree`` already knows tuples, lists, dicts, namedtuples, ``ModelOutput``
(transformers registers it) and registered dataclasses. Unregistered dataclasses are
flattened through a private node whose unflatten builds the user's class again, so the user's
types are never registered behind their back. ``torch.Size`` stays whole: it is a value,
not a container.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["flatten", "unflatten", "leaf_names", "flatten_values", "unflatten_values", "TreeSpec"]

TreeSpec = pytree.TreeSpec


class _DataclassNode:
    """Pytree stand-in for an instance of an *unregistered* dataclass."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: list[str], values: list[Any]) -> None:
        self.cls, self.names, self.values = cls, names, values


def _dc_unflatten(values: Iterable[Any], ctx: tuple[type, tuple[str, ...]]) -> Any:
    cls, names = ctx
    pairs = list(zip(names, values))
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{n: v for n, v in pairs if n in init})
    for n, v in pairs:
        if n not in init:
            object.__setattr__(obj, n, v)
    return obj


pytree.register_pytree_node(
    _DataclassNode,
    lambda n: (list(n.values), (n.cls, tuple(n.names))),
    _dc_unflatten,
    serialized_type_name="fxpipe.tree._DataclassNode",
    flatten_with_keys_fn=lambda n: ([(pytree.GetAttrKey(k), v) for k, v in zip(n.names, n.values)],
                                    (n.cls, tuple(n.names))),
)


def _is_plain_dataclass(obj: Any) -> bool:
    return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)
            and type(obj) not in pytree.SUPPORTED_NODES)


def _encode(obj: Any) -> Any:
    if not _is_plain_dataclass(obj):
        return obj
    names = [f.name for f in dataclasses.fields(obj)]
    values = [pytree.tree_map(_encode, getattr(obj, n), is_leaf=_is_whole_or_dataclass) for n in names]
    return _DataclassNode(type(obj), names, values)


def _is_whole(x: Any) -> bool:
    return isinstance(x, torch.Size)


def _is_whole_or_dataclass(x: Any) -> bool:
    return _is_whole(x) or _is_plain_dataclass(x)


def flatten(value: Any) -> Tuple[List[Any], TreeSpec]:
    """Leaves of ``value`` (tensors and plain values) and the spec that rebuilds it."""
    encoded = pytree.tree_map(_encode, value, is_leaf=_is_whole_or_dataclass)
    return pytree.tree_flatten(encoded, is_leaf=_is_whole)


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)


def _key_name(key: Any) -> str:
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(value: Any) -> List[str]:
    """A readable name per leaf, in :func:`flatten` order: ``'logits'``, ``'0'``,
    ``'hidden_states.2'``; ``''`` for a value that is itself a leaf."""
    encoded = pytree.tree_map(_encode, value, is_leaf=_is_whole_or_dataclass)
    paths = pytree.tree_flatten_with_path(encoded, is_leaf=_is_whole)[0]
    return [".".join(_key_name(k) for k in path) for path, _ in paths]


# Leaves that need no pytree work: the common case of a stage passing plain tensors on.
_ATOMS = (torch.Tensor, int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.Size)


def flatten_values(values: Sequence[Any]) -> Tuple[List[Any], Optional[TreeSpec]]:
    """Leaves of a list of values; a list of plain leaves costs no pytree work (spec None)."""
    if all(isinstance(v, _ATOMS) for v in values):
        return list(values), None
    return flatten(list(values))


def unflatten_values(leaves: Sequence[Any], spec: Optional[TreeSpec]) -> List[Any]:
    return list(leaves) if spec is None else unflatten(leaves, spec)
