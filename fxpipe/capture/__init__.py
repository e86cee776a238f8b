"""Capture: from a model and its sample to one flat, exact graph (the first step of the build).

torch.fx with fxpipe's leaf policy (:mod:`._tracing`), torch.export as the fallback
(:mod:`._export`, :mod:`._export_hops`, :mod:`._export_leaves`); what a trace must not lose:
grad/autocast regions (:mod:`._grad_regions`), augmented assignment (:mod:`._augmented`),
hooks (:mod:`._hooks`), re-entrant checkpoints (:mod:`._reentrant`), custom autograd Functions
(:mod:`._custom_functions`), in-place updates (:mod:`._mutation`), containers returned whole
(:mod:`._open_outputs`), meta-device models (:mod:`._meta`); the model left as it was
(:mod:`._prepare`). At call time, what a capture fixed is checked again: the call's inputs
against the sample (:mod:`._call_inputs`, :mod:`._signature`) and the model against what the
trace read from it (:mod:`._attr_reads`, :mod:`._model_check`).

Imports only :mod:`fxpipe.runtime` and the shared modules (errors, tree, progress) below it;
this ``__init__`` imports nothing, so ``fxpipe.capture.<module>`` loads only what it needs.
"""
