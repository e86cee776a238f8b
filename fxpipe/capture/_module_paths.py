"""A module's path as the model names it, from the path a capture's ``nn_module_stack`` holds.

torch.export writes the modules it went through as ``L['self'].transformer._modules['h']`` or
``L__self___transformer`` style paths, relative to the root it exported; torch.fx writes the
plain ``transformer.h.0``. The capture's node metadata (``fxpipe_module``) and the per-call
model check (every module whose forward was traced) both name modules as ``named_modules``
does.
"""

from __future__ import annotations

import re

__all__ = ["module_path"]


def module_path(path: str) -> str:
    """``transformer.h.0`` from any of the spellings above ('' for the root, and for export's
    placeholder of a node outside every module)."""
    if "nn_module_stack" in path:
        return ""
    path = re.sub(r"^L\['self'\]\.?|^L__self___?", "", path)
    return re.sub(r"\.?_modules\['([^']*)'\]", r".\1", path).strip(".")
