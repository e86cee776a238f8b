"""Putting each stage's parameters and buffers on its device, without copying them.

A tensor belongs to the first stage that uses it and moves there *in place*
(``t.data = t.data.to(device)``), so the Parameter objects the model, the optimizer and every
stage hold stay the same objects. A parameter read directly (``get_attr``, e.g. a tied
embedding used again by the LM head) by a later stage on another device gets a ``.to(device)``
in that stage's code: one Parameter, and autograd sums the gradients of both uses on the
owner's device, exactly as in eager. A whole submodule called from stages on different
devices cannot be split that way and is refused with a message saying how to fix it.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Dict, List, Tuple

import torch
import torch.fx
from torch import nn

from ..capture._tracing import retarget_devices
from ._stages import Stages

__all__ = ["place_stages", "move_in_place", "stage_tensors"]


def move_in_place(tensor: torch.Tensor, device: torch.device) -> None:
    """``tensor`` (and its ``.grad``) now on ``device``, as the same Python object. One on
    meta has no values to move and stays."""
    if tensor.is_meta:
        return
    if tensor.device != device:
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad.data = tensor.grad.data.to(device)


def stage_tensors(stage: torch.fx.GraphModule) -> List[torch.Tensor]:
    """Every tensor a stage holds: its (submodules') parameters and buffers, and the plain
    tensor attributes its code reads (constants a trace kept), each once."""
    found = {id(t): t for t in _module_tensors(stage)}
    for node in stage.graph.nodes:
        if node.op == "get_attr":
            value = attrgetter(node.target)(stage)
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), value)
    return list(found.values())


def _module_tensors(module: nn.Module) -> List[torch.Tensor]:
    return [*module.parameters(), *(b for b in module.buffers() if b is not None)]


def place_stages(stages: Stages, devices: List[torch.device], *, exported: bool = False) -> None:
    """Moves every stage's tensors to its device (first user owns a shared tensor)."""
    owner: Dict[int, Tuple[int, str]] = {}  # id(tensor) -> (stage, where it is used first)
    module_owner: Dict[int, Tuple[int, str]] = {}
    for k, stage in enumerate(stages.modules):
        device = devices[k]
        for node in list(stage.graph.nodes):
            if node.op == "call_module":
                module = stage.get_submodule(node.target)
                first = module_owner.setdefault(id(module), (k, node.target))
                if devices[first[0]] != device:
                    raise ValueError(
                        f"module '{node.target}' is called by stage {first[0]} ({devices[first[0]]}) and by "
                        f"stage {k} ({device}); a module's parameters live on one device. Put those stages "
                        "on one device, or choose split_points that keep its calls in one stage."
                    )
                for t in _module_tensors(module):
                    owner.setdefault(id(t), (k, node.target))
                    move_in_place(t, devices[owner[id(t)][0]])
            elif node.op == "get_attr":
                value = attrgetter(node.target)(stage)  # a dotted name, as fx's fetch_attr walks it
                if isinstance(value, nn.Module):  # a higher-order op's body: only this stage calls it
                    for t in _module_tensors(value):
                        move_in_place(t, device)
                    continue
                if not isinstance(value, torch.Tensor):
                    continue
                first_stage, _ = owner.setdefault(id(value), (k, node.target))
                move_in_place(value, devices[first_stage])
                if devices[first_stage] != device:
                    _read_on(stage, node, device)
        if exported:
            retarget_devices(stage, device)
        stage.recompile()


def _read_on(stage: torch.fx.GraphModule, node: torch.fx.Node, device: torch.device) -> None:
    """Makes ``stage`` read a tensor owned by another device through ``.to(device)``."""
    with stage.graph.inserting_after(node):
        moved = stage.graph.call_method("to", (node, device))
    node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
