"""Capture: from a model and its sample to one flat, exact graph (the first step of the build).

torch.fx with fxpipe's leaf policy (:mod:`.tracing`), torch.export as the fallback
(:mod:`.export`, :mod:`.export_hops`, :mod:`.export_leaves`); what a trace must not lose:
grad/autocast regions (:mod:`.grad_regions`), augmented assignment (:mod:`.augmented`),
hooks (:mod:`.hooks`), re-entrant checkpoints (:mod:`.reentrant`), custom autograd Functions
(:mod:`.custom_functions`), in-place updates (:mod:`.mutation`), containers returned whole
(:mod:`.open_outputs`), meta-device models (:mod:`.meta`); the model left as it was
(:mod:`.prepare`). At call time, what a capture fixed is checked again: the call's inputs
against the sample (:mod:`.call_inputs`, :mod:`.signature`) and the model against what the
trace read from it (:mod:`.attr_reads`, :mod:`.model_check`).

Imports only :mod:`fxpipe.runtime` and the shared modules (errors, tree, progress) below it;
this ``__init__`` imports nothing, so ``fxpipe.capture.<module>`` loads only what it needs.
"""
