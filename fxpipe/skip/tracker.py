"""torchgpipe's ``torchgpipe.skip.tracker`` import path, kept for its users and tests.

The skip trackers belong to the runtime (:mod:`fxpipe.runtime._skip_tracker`), which runs
them; this module only re-exports the names torchgpipe 0.0.7 had here, its misspelt
``SkipTrackerThroughPotals`` included, so that
``from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker`` keeps working with
``torchgpipe`` renamed to ``fxpipe``.
"""

from ..runtime._skip_tracker import SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker
from ..runtime._skip_tracker import _local as thread_local
from ..runtime._skip_tracker import _ThreadLocal as ThreadLocal

#: torchgpipe's spelling of :class:`SkipTrackerThroughPortals`
SkipTrackerThroughPotals = SkipTrackerThroughPortals

__all__ = ["SkipTracker", "SkipTrackerThroughPortals", "SkipTrackerThroughPotals", "use_skip_tracker",
           "current_skip_tracker", "ThreadLocal", "thread_local"]
