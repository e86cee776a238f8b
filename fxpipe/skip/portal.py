"""torchgpipe's ``torchgpipe.skip.portal`` import path, kept for its users and tests.

:class:`Portal` and its autograd functions belong to the runtime (:mod:`fxpipe.runtime._portal`);
this module only re-exports the names torchgpipe 0.0.7 had here, so that
``from torchgpipe.skip.portal import PortalBlue, PortalCopy, PortalOrange`` (its tests patch
them) keeps working with ``torchgpipe`` renamed to ``fxpipe``. torchgpipe's ``Context`` was
a type annotation for the functions' ``ctx`` and has no counterpart.
"""

from ..runtime._portal import Portal, PortalBlue, PortalCopy, PortalOrange

__all__ = ["Portal", "PortalBlue", "PortalOrange", "PortalCopy"]
