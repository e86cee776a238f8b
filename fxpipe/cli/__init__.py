"""The ``fxpipe`` command line: plan, render, code, timeline, env, demo, and the distributed
rank workers; ``hf:`` models, the model loader and pictures (:mod:`.viz`). On top of
everything: it builds through the same sequence as the library, so it refuses what the
library refuses.
"""
