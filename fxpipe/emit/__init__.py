"""Emit: one readable GraphModule per stage from the captured graph and its Plan.

The stages and their portal calls (:mod:`.stages`), stage modules whose errors point at the
generated and the model's line (:mod:`.stage_module`), the state a stage's recomputation must
snapshot (:mod:`.stage_state`), placement on devices (:mod:`.placement`) and torch.compile of
each stage (:mod:`.compiling`).

Imports :mod:`fxpipe.plan` and below; this ``__init__`` imports nothing.
"""
