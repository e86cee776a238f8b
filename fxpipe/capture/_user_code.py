"""Which source files are the user's: the one rule behind every source location fxpipe reports.

Error messages and generated stage code point at the line of the user's model that is at
fault ("File model.py, line 33"). The frames around it belong to torch, fxpipe and the
standard library; every place that walks a stack (capture's trace errors, the buffer
writers prepare reports, the source comments of stage code) skips them with this one test.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import traceback

from typing import Any

import torch

__all__ = ["is_user_file", "cached_is_user_file", "user_stack", "user_line", "source_location"]

_FRAME_RE = re.compile(r'^File "(.+)", line (\d+), in (.+)$')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FXPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
# Models shipped inside the package (the demo's U-Net) are user code for source locations.
_PACKAGED_MODELS = frozenset({os.path.join(_FXPIPE_DIR, "cli", "_demo.py")})


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


@functools.lru_cache(maxsize=4096)
def cached_is_user_file(filename: str) -> bool:
    return is_user_file(filename)


def user_stack() -> str:
    """The stack trace fx would record for a node being created (call it from the tracer's
    ``create_node``), kept to the model's frames: from the outermost ``forward`` on (fx's
    rule), in user files only; source lines are read for those frames alone (fx symbolises
    every frame through linecache: half of a big model's trace). '' when there is none."""
    frames = []
    frame = sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    start = next((i for i, f in enumerate(frames) if f.f_code.co_name == "forward"), None)
    if start is None:
        return ""
    kept = [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, None) for f in frames[start:]
            if cached_is_user_file(f.f_code.co_filename)]
    return "".join(traceback.StackSummary.from_list(kept).format()).strip() if kept else ""


def user_line() -> str:
    """``File "...", line N, in fn code`` of the innermost user frame on the current stack
    (what a refusal raised while tracing names), or ''."""
    where = user_stack().splitlines()
    return where[-2].strip() + " " + where[-1].strip() if len(where) >= 2 else ""


def source_location(node: Any) -> str | None:
    """``File "...", line N, in fn: code`` of the innermost *user* frame in the node's
    recorded ``stack_trace`` (see :mod:`fxpipe.capture._user_code`), or ``None``."""
    stack_trace = node.meta.get("stack_trace")
    if not stack_trace:
        return None
    lines = [line.strip() for line in str(stack_trace).strip().splitlines()]
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME_RE.match(line)
        if m:
            code = lines[i + 1] if i + 1 < len(lines) and not _FRAME_RE.match(lines[i + 1]) else ""
            frames.append((m.group(1), m.group(2), m.group(3), code))
    if not frames:
        return None
    user = [f for f in frames if is_user_file(f[0])]
    file, lineno, fn, code = (user or frames)[-1]
    return f'File "{file}", line {lineno}, in {fn}: {code}'
