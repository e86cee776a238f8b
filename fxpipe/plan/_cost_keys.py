"""Which graph nodes cost the same: one measurement per distinct node, reused for its copies.

A transformer is N copies of one block, so its captured graph holds N copies of every
node of the block: the same module class and code, parameters of the same shapes and
dtypes, inputs of the same shapes. Their forward + backward takes the same time, and timing
each copy again only adds build time (and noise). :func:`cost_key` gives two nodes the same
key exactly when they run the same code on same-shaped tensors with the same non-tensor
arguments; :mod:`fxpipe.plan._profile` times the first node of each key and gives its copies that
measurement, recording which node it came from (the plan says which were reused).

What is in a key (anything else gives the node a key of its own, i.e. no reuse):

* ``call_module``: the module's class and the code object of its ``forward`` (its
  ``.code`` for a GraphModule), its training flag, its own simple attributes (ints, floats,
  strings, ...: a ``Linear``'s sizes, a ``Dropout``'s ``p``, a flag that picks a branch), and
  every parameter's and buffer's name, shape, dtype, device and ``requires_grad``;
* ``call_function`` / ``call_method``: the function object or the method name;
* the arguments: a tensor by its shape, stride, dtype, device and ``requires_grad``; ``None``,
  numbers, strings, dtypes, devices, slices and containers of them by value; any other object
  by identity (never shared with a different object).
"""

from __future__ import annotations

import types
from typing import Any, Hashable, Optional

import torch
from torch import fx, nn

__all__ = ["cost_key"]

_SIMPLE = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
           torch.layout, type(Ellipsis))


def _value_key(v: Any) -> Hashable:
    """What of one argument the time depends on: a tensor's layout and type, a simple value."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()) if v.layout == torch.strided else None, v.dtype,
                str(v.device), v.requires_grad)
    if isinstance(v, _SIMPLE):
        return (type(v).__name__, v)
    if isinstance(v, slice):
        return ("slice", _value_key(v.start), _value_key(v.stop), _value_key(v.step))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((repr(k), _value_key(x)) for k, x in v.items()))
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        return ("fn", v)
    return ("id", id(v))  # an object not known to be a value: equal only to itself


def _code_key(module: nn.Module) -> Hashable:
    """The code a module runs: a GraphModule's generated code, else its class's forward."""
    if isinstance(module, fx.GraphModule):
        return ("graph", module.code)
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    return ("code", code if code is not None else id(forward))


def _state_key(module: nn.Module) -> Hashable:
    """A module's simple attributes and its tensors' layouts (not their values)."""
    simple = tuple(sorted((k, _value_key(v)) for k, v in vars(module).items()
                          if not k.startswith("_") and isinstance(v, _SIMPLE + (tuple, list))))
    tensors = tuple((name, _value_key(t)) for name, t in (*module.named_parameters(), *module.named_buffers()))
    return (module.training, simple, tensors)


def cost_key(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Optional[Hashable]:
    """The key under which ``node``'s forward + backward time may be shared with other nodes,
    given the values it is called with; ``None`` for nodes that are not computed."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        what: Hashable = ("module", type(module), _code_key(module), _state_key(module))
    elif node.op in ("call_function", "call_method"):
        what = (node.op, node.target)
    else:
        return None
    try:
        key = (what, _value_key(args), _value_key(kwargs))
        hash(key)
    except TypeError:  # an unhashable "simple" value somewhere: no sharing
        return None
    return key
