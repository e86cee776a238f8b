"""The parameters and buffers each stage holds, each tensor counted once per device.

A tensor used by two stages (a token embedding tied to the LM head) is one tensor where both
stages share a device: ``fxpipe.pipeline`` reads it from the stage that owns it
(``emit/_placement.py``), and two stages of one ``fxpipe.distributed`` rank hold the same
object. Only stages on different devices each keep their own copy (a rank per stage: one per
rank, its gradient summed over the ranks by ``distributed/_ties.py``). The plan's
``param_bytes`` counts such a tensor in every stage reading it, and once per read, so the
static bytes of a device are counted here from the graph instead: walking it is cheap, where
emitting the stages costs seconds on a 7B model on meta.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Collection, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.fx

from ..plan._value import Plan

__all__ = ["StageTensors", "stage_tensors", "once_per_device"]

#: per stage: id of each tensor it reads -> (its bytes, whether it is trained: a Parameter needing grad)
StageTensors = List[Dict[int, Tuple[int, bool]]]


def stage_tensors(gm: torch.fx.GraphModule, plan: Plan) -> StageTensors:
    """The parameters, buffers and constants each stage of ``plan`` reads, by identity: a
    module's (``call_module``) and a fetched attribute (``get_attr``, placed with its users
    when the plan does not assign it)."""
    found: StageTensors = [{} for _ in range(plan.n_stages)]
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            tensors = list(module.parameters()) + list(module.buffers())
        elif node.op == "get_attr":
            value = attrgetter(str(node.target))(gm)
            tensors = [value] if isinstance(value, torch.Tensor) else []
        else:
            continue
        stages = {int(plan.assignment[node.name])} if node.name in plan.assignment else {
            int(plan.assignment[u.name]) for u in node.users if u.name in plan.assignment}
        for stage in stages:
            for t in tensors:
                trained = isinstance(t, torch.nn.Parameter) and t.requires_grad
                found[stage][id(t)] = (t.numel() * t.element_size(), trained)
    return found


def once_per_device(tensors: StageTensors, stage_devices: Sequence[Hashable],
                    only: Optional[Collection[int]] = None) -> Tuple[List[int], List[int]]:
    """Per stage, the bytes of what it holds and of what it trains, leaving out each tensor an
    earlier stage on the same device already counted; the sums over a device's stages are
    then its tensors once each. ``only``: the ids of the tensors to count (the parameters,
    which FSDP shards, and not the buffers, which it leaves whole)."""
    seen: Dict[Hashable, set] = {}
    held, trained = [0] * len(tensors), [0] * len(tensors)
    for s, (found, device) in enumerate(zip(tensors, stage_devices)):
        mine = seen.setdefault(device, set())
        for key, (nbytes, grad) in found.items():
            if key in mine or (only is not None and key not in only):
                continue
            mine.add(key)
            held[s] += nbytes
            trained[s] += nbytes if grad else 0
    return held, trained
