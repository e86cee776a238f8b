"""Plan: where each node of the captured graph runs, and what crosses stages.

The :class:`Plan` value (:mod:`.value`), what crosses stages (:mod:`.routes`) and the
partitioner (:mod:`.partition`, :mod:`.chain_cut`) are pure: no torch. Profiling
(:mod:`.profile`, :mod:`.cost_keys`), the OpGraph (:mod:`.op_graph`) and "make a plan"
(:mod:`.make`) measure the captured graph with torch. ``import fxpipe.plan`` stays torch-free.

Imports :mod:`fxpipe.checks` and below.
"""

from .value import Plan

__all__ = ["Plan"]
