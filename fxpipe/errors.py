"""Typed exceptions raised by fxpipe.

They subclass the builtin exception a caller would naturally catch (``RuntimeError``,
``ValueError``) so that code written against plain PyTorch keeps working, while
fxpipe-aware code can catch the precise type.
"""

from __future__ import annotations


class FxpipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""


class TraceError(FxpipeError, RuntimeError):
    """The model could not be captured as a graph (neither torch.fx nor torch.export).

    The message names the module being traced, the original source line, the reason and
    what to do about it (usually: pass ``leaf_modules=[...]``). The underlying torch
    exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, module: str = "", location: str = "", reason: str = "") -> None:
        super().__init__(message)
        #: qualified name of the module whose forward failed ('' for the root)
        self.module = module
        #: "file:line: code" of the offending source line, '' if unknown
        self.location = location
        #: short human reason ("data-dependent control flow: ...")
        self.reason = reason
