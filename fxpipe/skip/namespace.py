"""Namespaces isolate skip names so one skippable class can be used many times."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A namespace for skip names, used by :meth:`Skippable.isolate`.

    Namespaces are ordered (by a random id) only so that layouts sort deterministically
    within a run.
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other: "Namespace") -> bool:
        return self.id < other.id
