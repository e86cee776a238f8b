"""The ``fxpipe`` subcommands (the parser and error policy are in :mod:`fxpipe.cli._main`).

Each ``cmd_<name>(ns)`` takes the parsed arguments and returns an exit code; mistakes are
raised (:class:`~fxpipe.cli._model_loader.UsageError` or the library's own exceptions) and turned
into one line on stderr by :func:`fxpipe.cli._main.main`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, List, Tuple

from ..progress import clear_status_line, status_line
from ._gpus import GPUS
from ._model_loader import UsageError, load_model

__all__ = ["cmd_plan", "cmd_render", "cmd_code", "cmd_timeline", "cmd_tune", "cmd_env", "cmd_demo",
           "training_loss", "load_model_and_sample"]


# -- helpers ---------------------------------------------------------------------------------
def _devices(ns: argparse.Namespace) -> list:
    """The stages' devices for ``--device`` (cpu by default, unlike the library)."""
    import torch

    from ..runtime._devices import default_devices

    name = (ns.device or "cpu").lower()
    if name == "cpu":
        return [torch.device("cpu")] * ns.stages
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
        if ":" in name:
            return [torch.device(name)] * ns.stages
        return default_devices(ns.stages)
    raise UsageError(f"--device must be cpu or cuda, got {ns.device!r}")


def _on_device(model: Any, args: tuple, kwargs: dict, device: Any) -> Tuple[Any, tuple, dict]:
    """The model (a model on meta stays there) and the sample's tensors on ``device``."""
    import torch
    from torch.utils import _pytree as pytree

    from ..capture._meta import is_meta_model

    if is_meta_model(model):
        return model, args, kwargs
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return model.to(device), pytree.tree_map(move, args), pytree.tree_map(move, kwargs)


def load_model_and_sample(ns: argparse.Namespace) -> Tuple[Any, tuple, dict]:
    """The model and sample; ``--balance-by`` resolved: ``params`` for a model on the meta
    device (``hf:`` models are built there; nothing to time), else ``time``."""
    from ._hf_models import PREFIX, load_hf
    from ..capture._meta import is_meta_model, to_meta

    status_line(f"loading {ns.model} ...")
    overrides = getattr(ns, "set", [])
    if ns.model.startswith(PREFIX):
        model, args, kwargs = load_hf(ns.model, ns.input, overrides, getattr(ns, "vocab", None))
    else:
        if overrides:
            raise UsageError(f"--set configures hf:<model_type> models (e.g. hf:llama --set num_hidden_layers=32); "
                             f"{ns.model} is built by its factory")
        model, args, kwargs = load_model(ns.model, ns.input, getattr(ns, "vocab", None) or 100)
    meta = is_meta_model(model)
    if meta:  # weights are shapes only: the sample joins them on meta (fxpipe.capture._meta)
        args, kwargs = to_meta(args, kwargs)
    if getattr(ns, "balance_by", "time") is None:
        ns.balance_by = "params" if meta else "time"
    return model, args, kwargs


def _plan(ns: argparse.Namespace, model: Any, args: tuple, kwargs: dict, devices: list) -> Any:
    """The capture and plan :func:`fxpipe.pipeline` would build, through the same sequence
    (:func:`fxpipe.build.build`, without emitting): the same checks, so what the library
    refuses is refused here with the same message."""
    from ..build import BuildOptions, build
    from ..progress import Progress

    clear_status_line()  # the build draws its own bar (fxpipe.progress), profiled on one micro-batch
    options = BuildOptions(ns.stages, ns.chunks, devices, ns.balance_by, tuple(ns.leaf), ns.split_at or None,
                           progress=Progress())  # off with --no-progress: fxpipe.progress.set_enabled
    return build(model, args, kwargs, options, emit=False)


def _pipeline(ns: argparse.Namespace, model: Any, args: tuple, kwargs: dict, *,
              checkpoint: str = "except_last") -> Any:
    import fxpipe

    clear_status_line()  # the build draws its own bar (fxpipe.progress)
    return fxpipe.pipeline(model, args, ns.stages, sample_kwargs=kwargs, chunks=ns.chunks,
                           devices=_devices(ns), checkpoint=checkpoint, balance_by=ns.balance_by,
                           leaf_modules=tuple(ns.leaf), split_points=ns.split_at or None,
                           progress=True)  # off with --no-progress: fxpipe.progress.set_enabled


def training_loss(out: Any) -> Any:
    """A scalar to call ``backward`` on: the sum of every floating-point output leaf."""
    import torch
    import torch.utils._pytree as pytree

    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.requires_grad]
    if not leaves:
        raise UsageError("the model's output has no floating-point tensor that requires grad: nothing to train")
    return sum(t.float().square().mean() for t in leaves)


# -- plan ------------------------------------------------------------------------------------
def _check_save_path(path: str) -> None:
    """Fail before the model is loaded and profiled, not after, when --save cannot be written."""
    if os.path.isdir(path):
        raise UsageError(f"--save {path}: it is a directory; pass a file path such as {os.path.join(path, 'plan.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--save {path}: the directory {parent} does not exist; create it first or pass another path")


def cmd_plan(ns: argparse.Namespace) -> int:
    if ns.save:
        _check_save_path(ns.save)
    model, args, kwargs = load_model_and_sample(ns)
    devices = _devices(ns)
    plan = _plan(ns, model, args, kwargs, devices).plan
    if ns.save:
        plan.save(ns.save)
    print(plan.to_json() if ns.json else str(plan))
    if ns.save and not ns.json:
        print(f"saved to {ns.save}")
    return 0


# -- render ----------------------------------------------------------------------------------
def cmd_render(ns: argparse.Namespace) -> int:
    from ..plan._make import opgraph_for
    from .viz._render import render_plan, save_graph

    suffix = os.path.splitext(ns.output)[1].lower().lstrip(".")
    if suffix not in ("svg", "png", "pdf", "jpg", "jpeg", "dot", "gv"):
        raise UsageError(f"-o {ns.output}: unknown format {suffix or '(none)'!r}; use .svg, .png, .pdf or .dot")
    if ns.depth is not None and ns.depth < 1:
        raise UsageError(f"--depth must be >= 1, got {ns.depth}")
    model, args, kwargs = load_model_and_sample(ns)
    devices = _devices(ns)
    built = _plan(ns, model, args, kwargs, devices)
    captured, plan = built.capture, built.plan
    graph = opgraph_for(captured, args, kwargs, "params", chunks=ns.chunks)  # shapes and sizes, one untimed run
    dot = render_plan(graph, plan, gm=captured.graph_module, depth=ns.depth, layout=ns.layout,
                      title=f"{type(model).__name__} in {plan.n_stages} stages (balanced by {plan.balance_by})")
    written, note = save_graph(dot, ns.output)
    if note:
        print(note, file=sys.stderr)
    print(f"wrote {written}")
    return 0


# -- code ------------------------------------------------------------------------------------
def cmd_code(ns: argparse.Namespace) -> int:
    model, args, kwargs = load_model_and_sample(ns)
    pipe = _pipeline(ns, model, args, kwargs)
    n = pipe.n_stages
    if ns.stage is not None:
        if not 0 <= ns.stage < n:
            raise UsageError(f"--stage {ns.stage} is out of range: the pipeline has stages 0..{n - 1}")
        print(pipe.stages.describe(ns.stage), end="")
    else:
        print(str(pipe.stages), end="")
    return 0


# -- timeline --------------------------------------------------------------------------------
def cmd_timeline(ns: argparse.Namespace) -> int:
    if ns.nproc is not None:
        return _on_ranks(ns)
    _refuse_nproc_options(ns)
    from ..runtime._devices import set_threads
    from ..runtime._timeline import Recorder
    from .viz._trace import have_matplotlib, plot_timeline, png_skipped, save_chrome_trace

    devices = _devices(ns)  # a bad --device fails before the model is loaded
    model, args, kwargs = load_model_and_sample(ns)
    model.train()
    threads = set_threads(ns.threads, devices)
    pipe = _pipeline(ns, model, args, kwargs, checkpoint=ns.checkpoint)

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        training_loss(pipe(*args, **kwargs)).backward()

    status_line("warm-up step ...")
    step()  # the first step pays one-time set-up costs; not recorded
    rec = Recorder()
    steps: List[Tuple[float, float]] = []
    with rec:
        for s in range(ns.steps):
            status_line(f"step {s + 1}/{ns.steps} ...")
            t = time.perf_counter()
            step()
            steps.append((t, time.perf_counter()))
    clear_status_line()
    base = os.path.splitext(ns.output)[0]
    png = base + ".png"
    title = (f"{type(model).__name__}: {pipe.n_stages} stages, {ns.chunks} micro-batches, "
             f"checkpoint={ns.checkpoint}, {threads} intra-op thread{'s' if threads != 1 else ''}")
    names = [str(d) for d in pipe.devices]
    n_events = save_chrome_trace(ns.output, rec.spans, names, steps=steps, title=title)
    total = steps[-1][1] - steps[0][0]
    print(f"recorded {ns.steps} step(s) in {total * 1e3:.1f} ms: {len(rec.spans)} spans")
    print(f"wrote {ns.output} ({n_events} events; open in https://ui.perfetto.dev or chrome://tracing)")
    if have_matplotlib():
        plot_timeline(png, rec.spans, names, steps=steps, title=title)
        print(f"wrote {png}")
    else:
        print(png_skipped(png))
    return 0


# -- env -------------------------------------------------------------------------------------
def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return "not installed"


def dot_version() -> str:
    """``'2.43.0'``-ish, or '' when the graphviz ``dot`` binary is not on PATH."""
    exe = shutil.which("dot")
    if not exe:
        return ""
    try:
        res = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001
        return "unknown version"
    text = (res.stderr or res.stdout).strip()
    marker = "version "
    return text.split(marker, 1)[1].strip() if marker in text else text or "unknown version"


def cmd_env(ns: argparse.Namespace) -> int:
    import torch

    import fxpipe

    from .viz._trace import PLOT_INSTALL

    rows = [("fxpipe", f"{fxpipe.__version__} ({os.path.dirname(fxpipe.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform()),
            ("torch", torch.__version__)]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
        rows.append(("devices", f"{len(names)} CUDA: " + ", ".join(f"cuda:{k} {n}" for k, n in enumerate(names))))
        rows.append(("cuda", str(torch.version.cuda)))
    else:
        rows.append(("devices", f"CPU only ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"))
    rows.append(("networkx", _version("networkx")))
    rows.append(("graphviz (python)", _version("graphviz")))
    dv = dot_version()
    rows.append(("graphviz dot", f"{dv} ({shutil.which('dot')})" if dv else
                 "not found: `fxpipe render` writes .dot files only (apt-get install graphviz / brew install graphviz)"))
    mpl = _version("matplotlib")
    rows.append(("matplotlib", mpl if mpl != "not installed" else
                 f"not installed: `fxpipe timeline` writes the JSON trace only ({PLOT_INSTALL})"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0


# -- demo ------------------------------------------------------------------------------------
def cmd_demo(ns: argparse.Namespace) -> int:
    if ns.nproc is not None:
        return _on_ranks(ns)
    _refuse_nproc_options(ns, "--steps")
    from ._demo import run_demo

    return run_demo(stages=ns.stages or 4, chunks=ns.chunks, balance_by=ns.balance_by or "time", threads=ns.threads)


# -- several processes (--nproc) -------------------------------------------------------------
def _refuse_nproc_options(ns: argparse.Namespace, *more: str) -> None:
    given = [o for o in ("--schedule", "--timeout", *more) if getattr(ns, o[2:]) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the distributed run only: "
                         "add --nproc N")


def _nproc_options(ns: argparse.Namespace) -> None:
    """Checks and completes the options of a --nproc run before any process starts."""
    from ..distributed._schedules import SCHEDULES

    ns.schedule = ns.schedule or "gpipe"
    if ns.schedule not in SCHEDULES:
        raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {ns.schedule!r}")
    schedule = SCHEDULES[ns.schedule]
    if ns.stages is None:  # only the demo has a default
        ns.stages = ns.nproc * (schedule.exactly or (1 if schedule.one is not None else 2))
    if ns.stages % ns.nproc:
        raise UsageError(f"--stages {ns.stages} with --nproc {ns.nproc}: every rank runs the same number of "
                         f"stages, so --stages must be a multiple of {ns.nproc}")
    ns.timeout = ns.timeout or ns.default_timeout
    if ns.command == "demo":
        ns.balance_by = ns.balance_by or "params"
        ns.steps = ns.steps or 3
        return
    from ._hf_models import PREFIX

    if (ns.device or "cpu").lower() != "cpu":
        raise UsageError(f"--device {ns.device} with --nproc: fxpipe.distributed runs on the CPU with gloo")
    if ns.model.startswith(PREFIX):
        raise UsageError(f"{ns.model} is built on the meta device (no weights), and --nproc runs the model: "
                         "use a factory that builds it on the CPU (path/to/file.py:factory)")
    parent = os.path.dirname(os.path.abspath(ns.output))
    if os.path.isdir(ns.output) or not os.path.isdir(parent):
        raise UsageError(f"-o {ns.output}: give a file path in an existing directory")
    ns.output = os.path.abspath(ns.output)  # the ranks write it; their working directory is ours anyway


def _on_ranks(ns: argparse.Namespace) -> int:
    """Runs the command on --nproc local ranks (torchrun, gloo) within --timeout seconds."""
    from ..distributed._launch import run_ranks

    _nproc_options(ns)
    finished = run_ranks(ns.nproc, vars(ns), timeout=ns.timeout)
    fail = f"fxpipe {ns.command}: error:"
    debug = getattr(ns, "debug", False)
    if debug and finished.stderr:
        print(finished.stderr, end="", file=sys.stderr)
    hint = "" if debug else " (--debug shows the ranks' tracebacks and torchrun's log)"
    if finished.timed_out:
        print(f"{fail} the {ns.nproc} ranks did not finish within --timeout {ns.timeout:g} s and were killed"
              f"{': ' + finished.error_summary() if finished.errors else ''}; raise --timeout for a bigger model"
              f"{hint}", file=sys.stderr)
        return 1
    if finished.errors:
        print(f"{fail} {finished.error_summary()}{hint}", file=sys.stderr)
        return 1
    if finished.returncode != 0 or finished.result is None:
        last = [ln for ln in finished.stderr.splitlines() if ln.strip()][-1:]
        print(f"{fail} torchrun exited with code {finished.returncode} and no rank reported a result"
              f"{'; its last line: ' + last[0].strip() if last else ''}{hint}", file=sys.stderr)
        return 1
    return 0 if finished.result.get("ok") else 1


# -- tune ------------------------------------------------------------------------------------
def cmd_tune(ns: argparse.Namespace) -> int:
    """``fxpipe tune MODEL --devices 8 --memory 80GiB``: the ranked table of fxpipe.tune."""
    import fxpipe
    from ._hf_models import PREFIX

    batch = None
    if ns.batch is not None:
        text = ns.batch.strip().lower()
        if "x" in text and ns.model.startswith(PREFIX) and not ns.input:
            ns.input = [f"{text}:int64"]  # token ids of that shape
        else:
            try:
                batch = int(text)
            except ValueError:
                raise UsageError(f"--batch {ns.batch}: expected a number of samples (64), or BxSEQ (64x2048) for an "
                                 "hf: language model") from None
    if ns.gpu is not None:  # a named kind: its figures where the user gave none
        kind = GPUS[ns.gpu]
        ns.device_flops = ns.device_flops or kind.device_flops
        ns.bandwidth = ns.bandwidth or kind.bandwidth
        ns.memory = ns.memory or kind.memory
        ns.link = ns.link or kind.link
    ns.link = ns.link or "450GB/s"
    model, args, kwargs = load_model_and_sample(ns)
    if ns.devices is not None and ns.device is None:
        devices: Any = ns.devices
    else:
        ns.stages = ns.devices or 4
        devices = _devices(ns)
        model, args, kwargs = _on_device(model, args, kwargs, devices[0])  # timed where it will run
    clear_status_line()
    tuning = fxpipe.tune(model, args, devices, ns.memory, batch=batch, sample_kwargs=kwargs,
                         schedules=tuple(ns.schedules or ("gpipe", "1f1b", "interleaved1f1b", "zbv")),
                         checkpoint=tuple(ns.checkpoint or ("never", "except_last", "always")),
                         chunks=ns.chunks, link=ns.link, latency=ns.latency,
                         send_overhead=ns.send_overhead, optimizer=ns.optimizer,
                         zero_grad=ns.zero_grad, device_flops=ns.device_flops,
                         bandwidth=ns.bandwidth, efficiency=ns.efficiency, leaf_modules=tuple(ns.leaf),
                         balance_by=ns.balance_by, replicas=ns.replicas)
    print(tuning)
    best = tuning.best
    where = " (fxpipe.distributed.pipeline)" if best.distributed else " (fxpipe.pipeline)"
    if best.replicas > 1:
        where = f" (fxpipe.distributed.pipeline, mesh=('dp', 'pp'), data_parallel={best.kwargs['data_parallel']!r})"
    print(f"best: {f'{best.replicas} replicas of ' if best.replicas > 1 else ''}{best.schedule}, {best.n_stages} "
          f"stages, chunks={best.chunks}, checkpoint={best.checkpoint!r}{where}")
    return 0
