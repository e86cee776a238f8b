"""Which source files are the user's: the one rule behind every source location fxpipe reports.

Error messages and generated stage code point at the line of the user's model that is at
fault ("File model.py, line 33"). The frames around it belong to torch, fxpipe and the
standard library; every place that walks a stack (capture's trace errors, the buffer
writers prepare reports, the source comments of stage code) skips them with this one test.
"""

from __future__ import annotations

import os

import torch

__all__ = ["is_user_file"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FXPIPE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
# Models shipped inside the package (the demo's U-Net) are user code for source locations.
_PACKAGED_MODELS = frozenset({os.path.join(_FXPIPE_DIR, "demo.py")})


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's: not generated (``<...>``), not torch, not
    fxpipe (its demo model excepted), not the standard library (installed packages are the
    user's: their models are the code a message should point at)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path in _PACKAGED_MODELS:
        return True
    if path.startswith((_TORCH_DIR, _FXPIPE_DIR)):
        return False
    return not (path.startswith(_STDLIB_DIR) and "site-packages" not in path)
