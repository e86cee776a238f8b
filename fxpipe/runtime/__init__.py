"""The GPipe runtime: micro-batches, clock cycles, Fork/Join, copy streams, checkpointing.

It runs a list of partitions on a list of devices and knows nothing about how the
partitions were made (an ``nn.Sequential`` split by ``fxpipe.GPipe``, or generated stage
code from ``fxpipe.pipeline``).
"""

from ._checkpoint import is_checkpointing, is_recomputing

__all__ = ["is_checkpointing", "is_recomputing"]
