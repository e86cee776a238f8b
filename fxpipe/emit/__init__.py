"""Emit: one readable GraphModule per stage from the captured graph and its Plan.

The stages and their portal calls (:mod:`._stages`), stage modules whose errors point at the
generated and the model's line (:mod:`._stage_module`), the state a stage's recomputation must
snapshot (:mod:`._stage_state`), placement on devices (:mod:`._placement`) and torch.compile of
each stage (:mod:`._compiling`).

Imports :mod:`fxpipe.plan` and below; this ``__init__`` imports nothing.
"""
