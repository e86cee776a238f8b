"""Checks: the build-time proof that micro-batching gives the model's own result.

How inputs split and outputs merge, verified on the sample (:mod:`._batching`); in eval and in
training mode (:mod:`._modes`); a merged loss's gradient (:mod:`._loss`) and token means over
counted labels (:mod:`._counted_labels`); at the precision in effect
(:mod:`fxpipe.capture._numerics`).

Imports :mod:`fxpipe.capture` and below; this ``__init__`` imports nothing.
"""
