"""Values between their producer's forward and a later stage's, on one device.

Why: ``held`` counts a storage at the stage that holds it for the backward (the producer
that saves it; checkpointed, the first stage that receives it). Between ``F(p, i)`` and the
forward of that stage, the value is still alive: the task's output waiting for the next
stage, a skip (a portal) waiting for the stage that pops it. Under GPipe every forward runs
before any backward, so nothing is in flight at the backward's peak; under one-process 1F1B
the first backward runs while later micro-batches' values are in flight. Measured on a
U-Net-like net whose first stage's features go to the third (issue 33): with checkpointing,
four stages, four micro-batches, two of those skips and two outputs waiting (0.69 MiB) were
missing at the first backward, 0.80 of the measured peak.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Set, Tuple

from ._boundaries import Storages

__all__ = ["in_flight"]


def in_flight(st: Storages, pool: Sequence[int], n_stages: int,
              attributed: Mapping[int, Set[int]]) -> List[Tuple[Tuple[int, int], ...]]:
    """Per producing stage ``p``: ``(t, bytes)`` of the storages it makes that no stage up to
    ``p`` of its pool holds (``attributed``: storage -> stages whose ``held`` counts it),
    alive from ``F(p, i)`` until ``F(t, i)``: ``t`` the first later stage of the pool that
    holds it, else its last reader there (after which nothing keeps it)."""
    per: List[Dict[int, int]] = [{} for _ in range(n_stages)]
    for key, nbytes, p, _ in st.spans():
        holders = {u for u in attributed.get(key, ()) if pool[u] == pool[p]}
        if any(u <= p for u in holders):
            continue  # held from the producer's forward on
        readers = [st.stage_of[r] for r in st.readers.get(key, [])]
        later = [t for t in readers if t > p and pool[t] == pool[p]]
        if not later:
            continue
        end = min(holders) if holders else max(later)
        per[p][end] = per[p].get(end, 0) + nbytes
    return [tuple(sorted(d.items())) for d in per]
