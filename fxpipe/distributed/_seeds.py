"""Ranks of one pipeline drawing the same random numbers: said at the build.

Each rank of ``fxpipe.distributed`` draws its stages' dropout masks from its own process's
generator. A script seeding every rank alike (``torch.manual_seed(0)``, as the guide's does for
the weights rank 0 broadcasts anyway) gives every rank the same stream, so stage 1's masks repeat
stage 0's bit for bit, micro-batch by micro-batch (a trial: four dropouts of 0.5 kept 0.263 of a
ones input, where eager keeps 1/16; one process draws every stage from one stream). Nothing in a
step can tell; the build can: where the graph draws random numbers and every rank of the
pipeline holds the same generator state, a warning names the fix (seed by rank after building).
Replicas of a pipeline (the mesh's ``dp`` dim) are not compared: same-seeded replicas are what
DDP scripts run.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["warn_same_draws"]

#: op names (function, method or aten op, overload dropped) that draw from the default generator
_DRAWS = ("dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "randperm",
          "normal", "exponential", "multinomial", "gumbel_softmax", "rrelu", "poisson")


def _draws(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
                return True
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        name = name.split(".")[0].strip("_")
        if "dropout" in name:  # F.dropout(h, p, training), aten.dropout(h, p, train): p=0 draws nothing
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
            if isinstance(p, (int, float)) and p == 0 or train is False:
                continue
            return True
        if name in _DRAWS or "bernoulli" in name:
            return True
    return False


def warn_same_draws(gm: fx.GraphModule, group: dist.ProcessGroup, device: torch.device) -> None:
    """On every rank of ``group`` (one pipeline's ranks; a collective): warns where ``gm`` draws
    random numbers and every rank's generator for ``device`` is in the same state."""
    world = dist.get_world_size(group)
    if world < 2:
        return
    draws = _draws(gm)
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    digest = int(hashlib.sha1(state.cpu().numpy().tobytes()).hexdigest()[:15], 16) if draws else -1
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if draws and len({int(t) for t in every}) == 1:
        warnings.warn(
            "fxpipe.distributed: every rank of this pipeline holds the same random generator state, and the model "
            "draws random numbers (dropout): each stage would draw the masks the others draw, correlated across "
            "the layers (one process draws them from one stream). Seed each rank apart after building, e.g. "
            "torch.manual_seed(base_seed + torch.distributed.get_rank()); the weights are rank 0's either way.",
            stacklevel=3)
