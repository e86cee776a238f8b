"""Where each skip starts and ends, by partition: the runtime's map of its portals.

A skip is keyed by ``(namespace, name)``: ``@skippable`` modules may put their names in a
:class:`~fxpipe.skip.Namespace`; generated stage code names each portal by its plan route and
uses no namespace (``None``).
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional, Tuple

__all__ = ["SkipLayout", "SkipKey"]

#: (namespace or None, name); the namespace is a ``fxpipe.skip.Namespace``
SkipKey = Tuple[Optional[Hashable], str]


class SkipLayout:
    """Routes of skip tensors: ``(ns, name) -> (stash partition, pop partition)``.

    The runtime asks it which skips must be carried by a portal (those crossing partitions)
    and which portals to copy into a partition before it runs.
    """

    def __init__(self, num_partitions: int, skip_routes: Dict[SkipKey, Tuple[int, int]]) -> None:
        self.num_partitions = num_partitions
        self.by_ns_name: Dict[SkipKey, Tuple[int, int]] = dict(skip_routes)
        self.by_partition: List[List[Tuple[int, Optional[Hashable], str]]] = [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in self.by_ns_name.items():
            if not (0 <= prev_j <= next_j < num_partitions):
                raise ValueError(
                    f"skip '{name}' goes from partition {prev_j} to {next_j}; a skip must be popped "
                    f"in the same or a later partition of 0..{num_partitions - 1}"
                )
            self.by_partition[next_j].append((prev_j, ns, name))
        for routes in self.by_partition:  # by source partition, as torchgpipe orders them
            routes.sort(key=lambda route: route[0])

    @classmethod
    def from_names(cls, num_partitions: int, routes: Dict[str, Tuple[int, int]]) -> "SkipLayout":
        """A layout of un-namespaced skips, as generated stage code uses."""
        return cls(num_partitions, {(None, name): route for name, route in routes.items()})

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Optional[Hashable], str]]:
        """The skips to carry into partition ``next_j`` from an earlier partition, nearest
        source last (ascending source partition; stashing order among those of one source)."""
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Optional[Hashable], name: str) -> bool:
        """Whether a skip crosses partitions (and so travels through a portal)."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j

    def __len__(self) -> int:
        return len(self.by_ns_name)
