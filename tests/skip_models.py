"""Small skippable models shared by tests/test_skip.py and tests/test_skip_portal.py.

The U-Net follows the conceptual U-Net of the torchgpipe docs (three Encoder/Decoder pairs
isolated by namespaces, a Bottleneck and a Segment head), with Linear layers so it runs in
milliseconds. Widths are chosen so that no tensor crossing a partition boundary ever has the
width of a skip tensor: a skip tensor found at a boundary is recognisable by its shape.

    main path widths   8 -> 12 -> 10 -> 6 -> 6 -> 10 -> 12 -> 8 -> 3
    skip widths        1f: 16, 2f: 20, 3f: 24
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

import torch
from torch import nn

from fxpipe import is_checkpointing, is_recomputing
from fxpipe.skip import Namespace, pop, skippable, stash

DTYPE = torch.float64
IN_WIDTH = 8
SKIP_WIDTHS = {"1f": 16, "2f": 20, "3f": 24}
# Index of each layer of unet(): 0..2 encoders, 3 bottleneck, 4..6 decoders, 7 segment.
STASH_LAYER = {"1f": 0, "2f": 1, "3f": 2}
POP_LAYER = {"3f": 4, "2f": 5, "1f": 6}

Hook = Callable[..., None]


@skippable(stash=["skip"])
class Encoder(nn.Module):
    def __init__(self, label: str, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.label = label
        self.lin = nn.Linear(cin, cskip)
        self.down = nn.Linear(cskip, cout)
        self.on_stash: Optional[Hook] = None   # on_stash(label, tensor)
        self.on_call: Optional[Hook] = None    # on_call(label, is_checkpointing, is_recomputing)

    def forward(self, x):
        if self.on_call is not None:
            self.on_call(self.label, is_checkpointing(), is_recomputing())
        h = torch.tanh(self.lin(x))
        if self.on_stash is not None:
            self.on_stash(self.label, h)
        yield stash("skip", h)
        return self.down(h)


@skippable(pop=["skip"])
class Decoder(nn.Module):
    def __init__(self, label: str, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.label = label
        self.up = nn.Linear(cin, cskip)
        self.out = nn.Linear(cskip, cout)
        self.on_pop: Optional[Hook] = None     # on_pop(label, tensor)
        self.on_call: Optional[Hook] = None

    def forward(self, x):
        if self.on_call is not None:
            self.on_call(self.label, is_checkpointing(), is_recomputing())
        u = self.up(x)
        skip = yield pop("skip")
        if self.on_pop is not None:
            self.on_pop(self.label, skip)
        return self.out(torch.tanh(u + skip))


class Bottleneck(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def unet(seed: int = 0) -> nn.Sequential:
    """The docs' conceptual U-Net: 3 encoders, bottleneck, 3 decoders, segment (8 layers)."""
    torch.manual_seed(seed)
    ns_1f, ns_2f, ns_3f = Namespace(), Namespace(), Namespace()
    model = nn.Sequential(
        Encoder("1f", 8, 16, 12).isolate(ns_1f),
        Encoder("2f", 12, 20, 10).isolate(ns_2f),
        Encoder("3f", 10, 24, 6).isolate(ns_3f),
        Bottleneck(6),
        Decoder("3f", 6, 24, 10).isolate(ns_3f),
        Decoder("2f", 10, 20, 12).isolate(ns_2f),
        Decoder("1f", 12, 16, 8).isolate(ns_1f),
        nn.Linear(8, 3),
    )
    return model.to(DTYPE)


def skippables(model: nn.Module) -> List[nn.Module]:
    """The user modules inside the @skippable wrappers of ``model``."""
    from fxpipe.skip import Skippable

    return [m.module for m in model.modules() if isinstance(m, Skippable)]


def partition_of(balance: List[int], layer: int) -> int:
    start = 0
    for j, size in enumerate(balance):
        if start <= layer < start + size:
            return j
        start += size
    raise IndexError(layer)


def crossing_skips(balance: List[int]) -> List[str]:
    """Labels of the U-Net skips whose stash and pop land in different partitions."""
    return sorted(
        label for label in SKIP_WIDTHS
        if partition_of(balance, STASH_LAYER[label]) != partition_of(balance, POP_LAYER[label])
    )


class WeakRecorder:
    """Collects weak references to every stashed tensor (never keeps one alive)."""

    def __init__(self) -> None:
        self.refs: List[weakref.ref] = []

    def __call__(self, label: str, tensor: torch.Tensor) -> None:
        self.refs.append(weakref.ref(tensor))

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)
