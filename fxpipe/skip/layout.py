"""torchgpipe's ``torchgpipe.skip.layout`` import path, kept for its users and tests.

:class:`SkipLayout` belongs to the runtime (:mod:`fxpipe.runtime._skip_layout`) and
:func:`inspect_skip_layout` sits next to ``Skippable`` (:mod:`fxpipe.skip.skippable`); this
module only re-exports the names torchgpipe 0.0.7 had here.
"""

from ..runtime._skip_layout import SkipLayout
from .skippable import inspect_skip_layout

__all__ = ["SkipLayout", "inspect_skip_layout"]
