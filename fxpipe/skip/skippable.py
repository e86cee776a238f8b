"""``@skippable``: modules that stash and pop skip tensors with ``yield``.

A skippable module's ``forward`` is a generator: ``yield stash(name, tensor)`` hands a
tensor to the current skip tracker, ``tensor = yield pop(name)`` takes one back. The
decorator turns the class into a :class:`Skippable` wrapper that runs the generator and
talks to the tracker, so the same module works in a plain ``nn.Sequential`` and in a
pipeline, where crossing skips travel through portals.
"""

from __future__ import annotations

from typing import (Any, Callable, ClassVar, Dict, FrozenSet, Generator, Iterable, List, Optional, Sequence, Set,
                    Tuple, Type, TypeVar)

from torch import Tensor, nn

from ..runtime._microbatch import Batch
from ..runtime._skip_layout import SkipKey, SkipLayout
from ..runtime._skip_tracker import current_skip_tracker
from .namespace import Namespace

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Skippable", "inspect_skip_layout"]

T = TypeVar("T", bound="Skippable")


class stash:
    """The command to stash a skip tensor: ``yield stash('name', tensor)``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command to pop a skip tensor: ``tensor = yield pop('name')``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """The base class of ``@skippable`` modules; wraps the user's module as ``.module``."""

    module_cls: ClassVar[Type[nn.Module]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> SkipKey:
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterable[SkipKey]:
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterable[SkipKey]:
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Puts all (or ``only`` the named) skips of this module into namespace ``ns``."""
        names: Iterable[str] = self.stashable_names | self.poppable_names if only is None else only
        for name in names:
            if name not in self.stashable_names and name not in self.poppable_names:
                raise ValueError(f"{self.module_cls.__name__} declares no skip named '{name}'")
            self.namespaces[name] = ns
        return self

    def dispatch(
        self, input: Any, handle_stash: Callable[[str, Optional[Tensor]], None],
        handle_pop: Callable[[str], Optional[Tensor]],
    ) -> Any:
        """Runs the wrapped forward, serving its stash/pop commands."""
        generator = self.module(input)
        if not isinstance(generator, Generator):
            return generator
        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    handle_stash(op.name, op.tensor)
                    op = next(generator)
                elif isinstance(op, pop):
                    op = generator.send(handle_pop(op.name))
                else:
                    raise TypeError(f"{op!r} is not a command from @skippable")
        except StopIteration as stop:
            return stop.value

    def forward(self, input: Any) -> Any:  # type: ignore[override]
        skip_tracker = current_skip_tracker()
        cls_name = self.module_cls.__name__
        batch = Batch(input)
        poppable: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = skip_tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed (popped by {cls_name})") from None
        input = batch.value
        stashed: Dict[str, Optional[Tensor]] = {}

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable by {cls_name}")
            stashed[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable by {cls_name}")
            return poppable.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)

        not_stashed = self.stashable_names - stashed.keys()
        if not_stashed:
            raise RuntimeError(f"{cls_name} did not stash {', '.join(repr(n) for n in sorted(not_stashed))}")
        if poppable:
            raise RuntimeError(f"{cls_name} did not pop {', '.join(repr(n) for n in sorted(poppable))}")

        batch = Batch(output)
        for ns, name in self.stashable():
            skip_tracker.save(batch, ns, name, stashed[name])
        return batch.value


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = (),
) -> Callable[[Type[nn.Module]], Type[Skippable]]:
    """The decorator declaring which skips a module stashes and pops."""
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: Type[nn.Module]) -> Type[Skippable]:
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashable_names,
            "poppable_names": poppable_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return type(module_cls.__name__, (Skippable,), attrs)

    return extend_skippable


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that every skip in ``module`` is stashed and popped exactly once, in order.

    Raises TypeError listing every mismatch.
    """
    stashed: Set[SkipKey] = set()
    popped: Set[SkipKey] = set()
    msgs: List[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            msgs.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for ns, name in layer.stashable():
            if name in layer.poppable_names:
                continue
            if (ns, name) in stashed:
                msgs.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace")
                continue
            stashed.add((ns, name))
        for ns, name in layer.poppable():
            if name in layer.stashable_names:
                continue
            if (ns, name) in popped:
                msgs.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace")
                continue
            if (ns, name) not in stashed:
                msgs.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed")
                continue
            popped.add((ns, name))
    for _, name in sorted(stashed - popped, key=lambda key: key[1]):
        msgs.append(f"no module declared '{name}' as poppable but stashed")
    if msgs:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {m}" for m in msgs))


def inspect_skip_layout(partitions: Sequence[nn.Module]) -> SkipLayout:
    """Finds the skip routes of ``@skippable`` layers inside ``partitions``."""
    routes: Dict[SkipKey, Tuple[int, int]] = {}
    stashed_at: Dict[SkipKey, int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition.modules():
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                stashed_at[key] = j
            for key in layer.poppable():
                if key in stashed_at:
                    routes[key] = (stashed_at.pop(key), j)
    return SkipLayout(len(partitions), routes)
