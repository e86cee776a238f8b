"""Checks: the build-time proof that micro-batching gives the model's own result.

How inputs split and outputs merge, verified on the sample (:mod:`.batching`); in eval and in
training mode (:mod:`.modes`); a merged loss's gradient (:mod:`.loss`) and token means over
counted labels (:mod:`.counted_labels`); at the precision in effect
(:mod:`fxpipe.capture.numerics`).

Imports :mod:`fxpipe.capture` and below; this ``__init__`` imports nothing.
"""
