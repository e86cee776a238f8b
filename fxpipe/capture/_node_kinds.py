"""Which fx nodes compute: the one definition the capture and the partitioner share.

Torch-free (``fxpipe.capture``'s ``__init__`` imports nothing), so the pure partitioner
(:mod:`fxpipe.plan._partition`) can import it where torch is not installed.
"""

__all__ = ["COMPUTE_OPS"]

#: node ops that run code (every other op is a placeholder, an attribute read or the output)
COMPUTE_OPS = frozenset({"call_module", "call_function", "call_method"})
