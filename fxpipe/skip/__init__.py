"""Skip connections across partitions (torchgpipe's ``torchgpipe.skip``).

``@skippable`` modules stash and pop tensors by name; ``verify_skippables`` checks that the
names pair up; ``Namespace`` isolates names of repeated modules. Skips that cross partitions
travel through portals, directly from the stash device to the pop device.
"""

from .namespace import Namespace
from .skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace", "Skippable"]
