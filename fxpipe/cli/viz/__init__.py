"""Pictures of a pipeline: the staged graph (graphviz) and the execution timeline.

* :func:`render_plan` / :func:`save_graph` -- one cluster per stage, boundary edges with
  bytes, portals dashed (``fxpipe render``);
* :func:`chrome_trace` / :func:`save_chrome_trace` -- recorded spans as Chrome-trace JSON
  for Perfetto / chrome://tracing; :func:`plot_timeline` -- the same as a PNG, one row per
  stage (``fxpipe timeline``).
"""

from ._render import render_plan, save_graph, stage_colors
from ._trace import chrome_trace, lanes, plot_timeline, save_chrome_trace

__all__ = ["render_plan", "save_graph", "stage_colors", "chrome_trace", "save_chrome_trace",
           "plot_timeline", "lanes"]
