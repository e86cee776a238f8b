"""The command line's MODEL and ``--input``, turned into a model and its sample.

The lowest layer of the command line: :mod:`fxpipe.cli._main` (parser, error policy) and
:mod:`fxpipe.cli._commands` (the subcommands) both import it, and it imports neither. A mistake
in what the user typed or in the model they pointed at is a :class:`UsageError`, which
``fxpipe.cli._main.main`` prints as one line (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Sequence, Tuple

__all__ = ["UsageError", "parse_input", "make_inputs", "load_factory", "load_model", "exit_text"]


class UsageError(Exception):
    """A mistake on the command line or in the user's model: one line, exit 2."""


# -- --input ---------------------------------------------------------------------------------
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64",
                  "int": "int32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_input(spec: str) -> Tuple[Tuple[int, ...], str]:
    """``'8x3x32x32'``, ``'8,3,32,32'`` or ``'16x128:int64'`` -> (shape, dtype name)."""
    text, _, dtype = spec.partition(":")
    dtype = _DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower()) or "float32"
    parts = re.split(r"[x,]", text.strip().lower())
    if not text.strip() or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"malformed --input {spec!r}: expected sizes like 8x3x32x32 or 8,3,32,32, "
                         "optionally followed by :dtype (e.g. 16x128:int64)")
    shape = tuple(int(p) for p in parts)
    if any(s == 0 for s in shape):
        raise UsageError(f"malformed --input {spec!r}: sizes must be positive")
    import torch

    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise UsageError(f"unknown dtype {dtype!r} in --input {spec!r}: use e.g. float32, float16, "
                         "bfloat16, float64, int64, int32 or bool")
    return shape, dtype


def make_inputs(specs: Sequence[str], vocab: int = 100, seed: int = 0) -> tuple:
    """Random tensors for ``--input`` specs: floats ~ N(0, 1), integers in [0, vocab)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        shape, name = parse_input(spec)
        dtype = getattr(torch, name)
        if dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        elif dtype.is_floating_point or dtype.is_complex:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.randint(0, vocab, shape, generator=gen).to(dtype))
    return tuple(out)


# -- MODEL -----------------------------------------------------------------------------------
def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path}")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:  # the model file may import its neighbours
        sys.path.insert(0, directory)
    name = "_fxpipe_model_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # a script's argparse / sys.exit() at import time
        raise UsageError(f"importing {path} exited with {exit_text(e)}: it runs code at import; put that "
                         "code under `if __name__ == '__main__':`") from e
    except Exception as e:  # noqa: BLE001 - the user's file: report, don't crash
        raise UsageError(f"importing {path} failed: {_one_line(e)}") from e
    return module


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise UsageError(f"no module named {name!r} (MODEL is 'path/to/file.py:factory' or "
                             "'package.module:factory')") from e
        raise UsageError(f"importing {name} failed: {_one_line(e)}") from e
    except SystemExit as e:
        raise UsageError(f"importing {name} exited with {exit_text(e)}: it runs code at import; put that "
                         "code under `if __name__ == '__main__':`") from e
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"importing {name} failed: {_one_line(e)}") from e


def load_factory(spec: str) -> Callable[[], Any]:
    """``'path/to/file.py:factory'`` or ``'package.module:factory'`` -> the factory."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"MODEL {spec!r} must be 'path/to/file.py:factory' or 'package.module:factory'")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    module = _import_file(where) if is_file else _import_module(where)
    factory = getattr(module, attr, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        hint = f" (callables there: {', '.join(public[:10])})" if public else ""
        raise UsageError(f"{where} has no factory {attr!r}{hint}")
    if not callable(factory):
        raise UsageError(f"{where}:{attr} is not callable (it is a {type(factory).__name__})")
    return factory


def load_model(spec: str, inputs: Sequence[str], vocab: int = 100) -> Tuple[Any, tuple, dict]:
    """Calls the factory: returns ``(model, args, kwargs)``; ``--input`` overrides its sample."""
    import torch
    from torch import nn

    from ..capture._signature import inputs_text, sample_mismatch

    factory = load_factory(spec)
    try:
        made = factory()
    except SystemExit as e:  # sys.exit() in the factory: not fxpipe's exit status to pass on
        raise UsageError(f"factory {spec} exited with {exit_text(e)} instead of returning a model; "
                         "make it return the model (or (model, args))") from e
    except Exception as e:  # noqa: BLE001 - the user's code
        raise UsageError(f"factory {spec} raised {_one_line(e)}") from e
    args: Any = None
    kwargs: dict = {}
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Module) and len(made) in (2, 3):
        model, args = made[0], made[1]
        if len(made) == 3:
            kwargs = dict(made[2] or {})
    else:
        model = made
    if not isinstance(model, nn.Module):
        raise UsageError(f"factory {spec} returned {type(made).__name__}; expected an nn.Module or "
                         "(module, args)")
    if inputs:
        args, kwargs = make_inputs(inputs, vocab), {}
        if sample_mismatch(model, args, kwargs):
            raise UsageError(f"{type(model).__name__}.forward {inputs_text(model)}, but {len(inputs)} --input "
                             "were given: give one --input per positional input of forward")
    elif args is None:
        raise UsageError(f"factory {spec} returns no sample input: pass --input SHAPE (e.g. --input 8x3x32x32)")
    if isinstance(args, torch.Tensor):
        args = (args,)
    elif isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        args = (args,)
    return model, args, kwargs


# -- messages -------------------------------------------------------------------------------
def exit_text(e: SystemExit) -> str:
    """``'sys.exit(5) (exit code 5)'`` for a SystemExit raised by the user's code."""
    code = e.code
    if code is None:
        return "sys.exit() (exit code 0)"
    if isinstance(code, int):
        return f"sys.exit({code!r}) (exit code {int(code)})"
    text = " ".join(str(code).split())
    return f"sys.exit({text[:80]!r}) (exit code 1)"


def _one_line(e: BaseException) -> str:
    """``'ValueError: first line; second line'`` -- a message that fits one line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = "; ".join(lines)
    name = type(e).__name__
    return f"{name}: {text}" if text else name
