"""Plan: where each node of the captured graph runs, and what crosses stages.

The :class:`Plan` value (:mod:`._value`), what crosses stages (:mod:`._routes`) and the
partitioner (:mod:`._partition`, :mod:`._chain_cut`) are pure: no torch. Profiling
(:mod:`._profile`, :mod:`._cost_keys`), the OpGraph (:mod:`._op_graph`) and "make a plan"
(:mod:`._make`) measure the captured graph with torch. ``import fxpipe.plan`` stays torch-free.

Imports :mod:`fxpipe.checks` and below.
"""

from ._value import Plan

__all__ = ["Plan"]
