"""Whether the code running now is inside a call of a module kept opaque (torch.export).

torch.export traces *into* the modules kept opaque (``leaf_modules``) and collapses each call
to one node afterwards (:mod:`._export_leaves`); at call time those modules run their own
forward again. So what their code does while export traces is theirs, not the graph's: a
custom autograd Function they apply (:mod:`._custom_functions`) or an attribute they read
(:mod:`._attr_reads`). One tracker answers for both, from global forward hooks counting the
calls of those modules on the tracing thread.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, List

from torch import nn

__all__ = ["OpaqueCalls"]


class OpaqueCalls:
    """``with OpaqueCalls(modules) as calls:`` -- ``calls.inside`` says whether a forward of
    one of ``modules`` is running on the entering thread. No modules: never inside, no hooks."""

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._ids = {id(m) for m in modules}
        self._depth = 0
        self._thread = 0
        self._hooks: List[Any] = []

    @property
    def inside(self) -> bool:
        return self._depth > 0 and threading.get_ident() == self._thread

    def __enter__(self) -> "OpaqueCalls":
        self._thread = threading.get_ident()
        if self._ids:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            self._hooks = [register_module_forward_pre_hook(self._enter),
                           register_module_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._depth = 0

    def _enter(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._ids and threading.get_ident() == self._thread:
            self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self._ids and threading.get_ident() == self._thread:
            self._depth -= 1
