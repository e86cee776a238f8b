"""``fxpipe`` / ``python -m fxpipe``: plan, render, code, timeline, tune, env, demo.

This module owns the command line only: the argument parser and the error policy. The
subcommands live in :mod:`fxpipe.cli._commands`; turning ``MODEL`` and ``--input`` into a model
and sample, in :mod:`fxpipe.cli._model_loader` (its ``UsageError``, ``parse_input`` and
``load_factory`` stay importable from here).

Error policy: a mistake in what the user typed or in the model they pointed at (unknown
file, missing factory, malformed shape, a factory that raises or calls ``sys.exit()``, a
model that fails to trace, bad ``--stages``) prints ONE line on stderr and exits 2;
``--debug`` shows the traceback. Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import traceback
from typing import Callable, List, Optional

from . import _commands as commands
from ..progress import set_enabled
from ._gpus import GPUS
from ._model_loader import UsageError, exit_text, load_factory, parse_input

__all__ = ["main", "UsageError", "load_factory", "parse_input", "build_parser", "error_line"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


# -- parser ----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {text!r}")
        return value
    return parse


def _model_args(p: argparse.ArgumentParser, *, chunks: bool = False, balance: bool = True) -> None:
    p.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory; "
                   "the factory returns a module or (module, args). Or hf:<model_type> (hf:llama): a "
                   "transformers architecture from its default config, built on the meta device (no download)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="hf: models: override a config value (repeatable), e.g. --set num_hidden_layers=32")
    p.add_argument("--stages", "-n", type=_positive_int("--stages"), required=True, metavar="N",
                   help="number of pipeline stages")
    p.add_argument("--input", "-i", action="append", default=[], metavar="SHAPE[:dtype]",
                   help="one per positional input: 8x3x32x32 or 8,3,32,32, optional :dtype "
                        "(float32 default; :int64 gives token ids in [0, --vocab))")
    p.add_argument("--vocab", type=_positive_int("--vocab"), default=None,
                   help="range of integer inputs (default 100; an hf: model's vocab_size)")
    if balance:
        p.add_argument("--balance-by", choices=("time", "memory", "params"), default=None,
                       help="what to balance: profiled time (default), memory, or parameters (fast, deterministic; "
                            "the default for models on the meta device, which cannot be timed)")
    p.add_argument("--leaf", action="append", default=[], metavar="NAME",
                   help="qualified submodule name to keep opaque (repeatable)")
    p.add_argument("--split-at", action="append", default=[], metavar="NAME",
                   help="cut before this module (repeat N-1 times); overrides balancing")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: the devices of the stages")
    p.add_argument("--chunks", "-m", type=_positive_int("--chunks"), default=4 if chunks else 1, metavar="M",
                   help="micro-batches per mini-batch" + (" (default 4)" if chunks else
                                                          " (plans are profiled on one micro-batch)"))


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show Python tracebacks on errors")
    common.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS,
                        help="no status line or progress bar on the terminal (none is drawn when stderr is "
                             "not a terminal anyway)")
    parser = _Parser(prog="fxpipe", parents=[common],
                     description="Automatic GPipe pipeline parallelism for any nn.Module (torch.fx).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("plan", parents=[common], help="print how the model is cut into stages")
    _model_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--save", metavar="PATH", help="also save the plan as JSON (reuse: pipeline(..., plan=PATH))")

    p = sub.add_parser("render", parents=[common], help="draw the staged graph with graphviz")
    _model_args(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="graph.svg, graph.png, graph.pdf or graph.dot")
    p.add_argument("--depth", type=int, default=None, metavar="K",
                   help="merge nodes by module depth K (1 = one node per top-level submodule)")
    p.add_argument("--layout", choices=("columns", "lr", "tb"), default="columns",
                   help="columns: stages side by side, each read top-down (default); lr / tb: one chain")

    p = sub.add_parser("code", parents=[common], help="print the generated stage code")
    _model_args(p)
    p.add_argument("--stage", type=int, default=None, metavar="K", help="only stage K")

    p = sub.add_parser("timeline", parents=[common],
                       help="run training steps, write a Chrome trace (JSON) and a PNG timeline")
    _model_args(p, chunks=True)
    p.add_argument("-o", "--output", default="trace.json", metavar="FILE",
                   help="Chrome trace JSON (default trace.json); the PNG goes next to it")
    p.add_argument("--steps", type=_positive_int("--steps"), default=1, help="recorded steps (after one warm-up)")
    p.add_argument("--checkpoint", choices=("always", "except_last", "never"), default="except_last")
    _threads_arg(p)
    _nproc_args(p, timeout=600, what="one lane per rank; --stages must be a multiple of N")

    p = sub.add_parser("tune", parents=[common],
                       help="predict and rank stages, micro-batches, schedule and checkpointing for the devices")
    p.add_argument("model", metavar="MODEL", help="as for fxpipe plan (hf:<model_type> builds on meta)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="hf: models: a config value")
    p.add_argument("--input", "-i", action="append", default=[], metavar="SHAPE[:dtype]", help="as for fxpipe plan")
    p.add_argument("--vocab", type=_positive_int("--vocab"), default=None, help="range of integer inputs")
    p.add_argument("--leaf", action="append", default=[], metavar="NAME", help="submodule to keep opaque")
    p.add_argument("--devices", type=_positive_int("--devices"), default=None, metavar="N",
                   help="N identical devices (default: --device cpu, N=4 stages on it)")
    p.add_argument("--device", default=None, help="cpu or cuda: tune for these devices, repeated N times")
    p.add_argument("--memory", default=None, metavar="SIZE", help="memory per device: 80GiB, 24GB, bytes")
    p.add_argument("--batch", default=None, metavar="B[xSEQ]",
                   help="the mini-batch: B samples; BxSEQ for hf: language models (token ids of that shape)")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS), type=str.lower,
                   help="a named GPU kind: its data-sheet peak FLOP/s, bandwidth, memory and link stand in for "
                        "--device-flops, --bandwidth, --memory and --link where those are not given")
    p.add_argument("--device-flops", default=None, metavar="FLOP/S", help="peak FLOP/s of one device (790e12)")
    p.add_argument("--bandwidth", default=None, metavar="BYTES/S", help="memory bandwidth of one device (4.8e12)")
    p.add_argument("--efficiency", type=_positive_float("--efficiency"), default=None,
                   help="share of that peak reached (default 1)")
    p.add_argument("--link", default=None, metavar="BYTES/S",
                   help="bandwidth between devices (default: the --gpu kind's, else 450GB/s)")
    p.add_argument("--latency", default="0", metavar="TIME",
                   help="of every send between devices, whatever its size (20us; default 0)")
    p.add_argument("--send-overhead", default="0", metavar="TIME",
                   help="each send's cost to the two devices' own time, not overlapped with compute "
                        "(about 1ms on gloo ranks sharing busy CPU cores; default 0)")
    p.add_argument("--schedules", nargs="+", default=None, metavar="S",
                   help="gpipe (fxpipe.pipeline) 1f1b interleaved1f1b interleavedzb zbv (fxpipe.distributed)")
    p.add_argument("--checkpoint", nargs="+", default=None, choices=("never", "except_last", "always"))
    p.add_argument("--chunks", nargs="+", type=_positive_int("--chunks"), default=None, metavar="M")
    p.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam", "adamw"))
    p.add_argument("--zero-grad", default="set_to_none", choices=("set_to_none", "in_place"),
                   help="how .grad is cleared between steps (in_place: also gradient accumulation)")
    p.add_argument("--balance-by", choices=("time", "memory", "params"), default=None,
                   help="how each stage count is cut (default: time; params on meta)")
    p.add_argument("--replicas", nargs="*", type=_positive_int("--replicas"), default=None, metavar="DP",
                   help="data-parallel replica counts to consider beside one pipeline (default: every DP "
                        "dividing --devices that leaves 2 per pipeline or more; none given: none)")

    sub.add_parser("env", parents=[common], help="versions, devices, graphviz and matplotlib availability")

    p = sub.add_parser("demo", parents=[common],
                       help="pipeline a U-Net, check outputs and gradients against eager")
    p.add_argument("--stages", "-n", type=_positive_int("--stages"), default=None,
                   help="pipeline stages (default 4; with --nproc N: N, or 2N for schedules of several stages per "
                        "rank; a multiple of N)")
    p.add_argument("--chunks", "-m", type=_positive_int("--chunks"), default=4)
    p.add_argument("--balance-by", choices=("time", "memory", "params"), default=None,
                   help="what to balance (default time; with --nproc: params)")
    _threads_arg(p)
    _nproc_args(p, timeout=300, what="trained --steps steps with SGD and compared with eager (losses, gradients, "
                                     "parameters)")
    p.add_argument("--steps", type=_positive_int("--steps"), default=None,
                   help="with --nproc: training steps compared with eager (default 3)")
    return parser


def _nproc_args(p: argparse.ArgumentParser, *, timeout: int, what: str) -> None:
    p.add_argument("--nproc", type=_positive_int("--nproc"), default=None, metavar="N",
                   help=f"run with fxpipe.distributed on N local processes (torchrun, gloo on 127.0.0.1): {what}")
    p.add_argument("--schedule", default=None,
                   help="with --nproc: gpipe (default), 1f1b, or for several stages per rank gpipe or interleaved1f1b")
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=None, metavar="SECONDS",
                   help=f"with --nproc: the ranks are killed after this many seconds (default {timeout})")
    p.set_defaults(default_timeout=float(timeout))


def _positive_float(what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a positive number, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{what} must be a positive number, got {text!r}")
        return value
    return parse


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, metavar="T",
                   help="torch intra-op threads (default: 1 when every stage is on the CPU -- the stage "
                        "workers run concurrently and would oversubscribe the cores -- else torch's default)")


# -- errors ----------------------------------------------------------------------------------
_LOCATION = re.compile(r'File "([^"]+)", line (\d+), in \w+\s*\n\s*(.+)')


def error_line(e: BaseException) -> str:
    """One line for any exception: ours in full, other libraries' first line plus where."""
    from ..errors import FxpipeError

    text = str(e).strip()
    if isinstance(e, (UsageError, FxpipeError, ValueError, IndexError)):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        joined = ""
        for ln in lines:  # "a.\n  b: c" -> "a. b: c"; "a\nb" -> "a; b"
            sep = "" if not joined else (" " if joined.endswith((".", ":", ";")) else "; ")
            joined += sep + " ".join(ln.split())
        if isinstance(e, (UsageError, FxpipeError)) or not joined:
            return joined or type(e).__name__
        return joined
    first = text.splitlines()[0].strip() if text else ""
    where = _LOCATION.search(text)
    at = f" (at {where.group(1)}:{where.group(2)}: {where.group(3).strip()})" if where else ""
    return f"{type(e).__name__}: {first}{at}" if first else type(e).__name__


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``fxpipe`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = getattr(ns, "debug", False)
    set_enabled(not getattr(ns, "no_progress", False))
    try:
        return int(getattr(commands, f"cmd_{ns.command}")(ns) or 0)
    except KeyboardInterrupt:
        print("fxpipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fxpipe plan ... | head`
        return EXIT_OK
    except SystemExit as e:  # sys.exit() in the model's code (its forward, while tracing or running)
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"fxpipe {ns.command}: error: the model's code exited with {exit_text(e)}; "
              f"remove the sys.exit() call from it{hint}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the error policy: one line, or the traceback
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"fxpipe {ns.command}: error: {error_line(e)}{hint}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
