"""fxpipe: automatic GPipe pipeline parallelism for any nn.Module.

* ``fxpipe.GPipe(nn.Sequential, balance, ...)`` -- the torchgpipe-compatible API;
* ``fxpipe.skip`` -- ``@skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``;
* ``fxpipe.balance`` -- ``balance_by_time``, ``balance_by_size``.
"""

from .gpipe import GPipe
from .runtime.checkpoint import is_checkpointing, is_recomputing

__version__ = "0.1.0"

__all__ = ["GPipe", "is_checkpointing", "is_recomputing", "__version__"]
