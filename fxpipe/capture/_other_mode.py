"""The user's opaque modules in their other mode, for the search of the state they write.

The search for writes (:mod:`fxpipe.capture._mutation`) runs the graph once, in the mode the
model is built in. A module of the user's kept opaque (it has hooks, torch.fx cannot trace it,
``leaf_modules=``) runs its own code, which may write state in one mode only: an average
updated under ``if self.training:``. Built in eval mode (a first validation pass) and then
trained, such a write was never found, and a checkpointed stage's recomputation applied it a
second time (a trial: 4 steps counted for 2). torch.nn's own layers are left as they are:
BatchNorm's statistics are handled whatever the mode (:mod:`fxpipe.runtime._batchnorm`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

from torch import fx, nn

__all__ = ["opaque_with_buffers", "flipped_modes"]


def opaque_with_buffers(gm: fx.GraphModule) -> List[nn.Module]:
    """The modules ``gm`` calls as one node that are not torch's own and hold buffers."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if not type(module).__module__.startswith("torch.") and any(True for _ in module.buffers()):
            found[id(module)] = module
    return list(found.values())


@contextmanager
def flipped_modes(modules: List[nn.Module]) -> Iterator[bool]:
    """Each of ``modules`` and everything inside it switched to the other mode (``training``
    flipped, set directly: no ``train()`` override runs), put back after; yields whether any."""
    flags = [(m, m.training) for top in modules for m in top.modules()]
    try:
        for m, training in flags:
            m.training = not training
        yield bool(flags)
    finally:
        for m, training in flags:
            m.training = training
