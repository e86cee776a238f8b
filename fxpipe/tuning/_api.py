"""``fxpipe.tune(model, sample, devices, memory)``: the configuration to build, predicted.

The model is captured and checked once, exactly as ``fxpipe.pipeline`` captures it
(:func:`fxpipe.build.capture_and_check`): what tune recommends, the build accepts. Then
:class:`~fxpipe.tuning._search.Search` predicts every candidate and ranks them. If none fits
the memory, :class:`~fxpipe.errors.MemoryBudgetError` names the one that needs the least.
"""

from __future__ import annotations

import math

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..build import BuildOptions, capture_and_check
from ..capture._prepare import preserved
from ..checks._batching import ChunkDims, OutputMerge
from ..errors import ArgumentError, MemoryBudgetError
from ..plan._make import BALANCE_BY
from ..progress import ProgressOption, as_progress
from ..runtime._frontend import CHECKPOINT_MODES
from ._memory import OPTIMIZER_STATES, ZERO_GRAD
from ._orders import DISTRIBUTED_SCHEDULES
from ._data_parallel import replica_choices, replica_counts, replicas_note
from ._result import Tuning
from ._search import Search, Settings, ranked
from ._units import Seconds, Size, format_bytes, format_seconds, parse_bytes, parse_rate, parse_seconds

__all__ = ["tune", "SCHEDULES"]

#: the schedules tune knows: 'gpipe' is fxpipe.pipeline, the others fxpipe.distributed's
SCHEDULES = tuple(DISTRIBUTED_SCHEDULES)


def _devices(devices: Union[int, Sequence[Any], None]) -> tuple[List[str], Optional[List[torch.device]]]:
    if devices is None:
        return ["cpu"], [torch.device("cpu")]
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ArgumentError(f"devices must be a positive count or a list of devices, got {devices!r}",
                                argument="devices")
        return [str(i) for i in range(devices)], None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
        raise ArgumentError(f"devices must be a count (devices=8) or a list (devices=['cuda:0', 'cuda:1']), "
                            f"got {devices!r}", argument="devices")
    found = [torch.device(d) for d in devices]
    return [str(d) for d in found], found


def _check_timed_where_it_runs(model: nn.Module, devices: Optional[List[torch.device]], flops: Optional[float]) -> None:
    """Stage times are measured where the model's tensors are: for the devices named, the model
    must be on that kind of device (else a CPU's times would stand for GPUs', silently)."""
    if devices is None or flops is not None:
        return
    where = {t.device.type for t in (*model.parameters(), *model.buffers())} - {"meta"}
    kinds = {d.type for d in devices}
    if where and where != kinds:
        raise ArgumentError(f"the model's tensors are on {', '.join(sorted(where))} but devices= names "
                            f"{', '.join(sorted(kinds))}: tune times the stages where the model is. Move the model "
                            f"to one of the devices first (tune leaves it there), or pass device_flops= and "
                            f"bandwidth= for costs from shapes", argument="devices")


def _chunk_choices(batch: int, chunks: Optional[Sequence[int]]) -> List[int]:
    if chunks is not None:
        bad = [c for c in chunks if not isinstance(c, int) or isinstance(c, bool) or c < 1]
        if bad or not chunks:
            raise ArgumentError(f"chunks must be positive integers, got {chunks!r}", argument="chunks")
        return sorted(set(chunks))
    found, c = [], 1
    while c <= batch:
        if batch % c == 0:
            found.append(c)
        c *= 2
    return found


def tune(model: nn.Module, sample: Any, devices: Union[int, Sequence[Any], None] = None,
         memory: Optional[Size] = None, *, batch: Optional[int] = None,
         schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved1f1b", "zbv"),
         checkpoint: Sequence[str] = ("never", "except_last", "always"),
         chunks: Optional[Sequence[int]] = None, link: Size = "450GB/s", latency: Seconds = 0.0,
         send_overhead: Seconds = 0.0, optimizer: str = "adam", zero_grad: str = "set_to_none",
         device_flops: Optional[Size] = None, bandwidth: Optional[Size] = None, efficiency: Optional[float] = None,
         sample_kwargs: Optional[dict] = None, leaf_modules: Sequence[Union[type, str]] = (),
         chunk_dims: ChunkDims = 0, output_merge: Optional[OutputMerge] = None,
         balance_by: Optional[str] = None, replicas: Optional[Sequence[int]] = None,
         loss_fn: Optional[Callable[..., Any]] = None, target: Any = None,
         progress: ProgressOption = False) -> Tuning:
    """Predicts and ranks pipeline configurations of ``model`` for ``devices`` with ``memory``
    each (see docs/api.md, "fxpipe.tuning").

    Args:
        model, sample, sample_kwargs, leaf_modules, chunk_dims, output_merge: as for
            :func:`fxpipe.pipeline`; ``sample``'s batch is the mini-batch unless ``batch``.
        devices: a count of identical devices (a model on meta, with ``device_flops`` and
            ``bandwidth``), or the devices themselves (``['cuda:0', 'cuda:1']``; a device
            repeated shares its memory and its time: ``['cpu'] * 4``). Default: one CPU.
        memory: per device (``'80GiB'``, bytes); None: no limit.
        batch: the mini-batch size, when it is not the sample's (micro-batches are cut from
            the sample, repeated if it is smaller).
        schedules: ``'gpipe'`` (``fxpipe.pipeline``, one process), ``'1f1b'`` (both:
            ``fxpipe.pipeline(schedule='1f1b')`` in one process, and ``fxpipe.distributed``),
            ``'interleaved1f1b'``, ``'interleavedzb'``, ``'zbv'`` (``fxpipe.distributed``).
        checkpoint: the modes to consider; chunks: the micro-batch counts (default: the powers
            of two dividing the batch).
        link, latency: the link between devices, for the sends between stages: a send of ``n``
            bytes takes ``latency + n / link`` (``'450GB/s'``; ``'20us'`` or seconds); ``link=None``:
            bytes cost nothing.
        send_overhead: what each send costs the sending and the receiving device's own time (its
            host thread posts, waits for and completes it), not overlapped with compute: a few
            microseconds with NCCL; about a millisecond on gloo ranks sharing busy CPU cores,
            where gloo's I/O thread must wait for a core (measure it under load, as
            ``benchmarks/_tune_dist.py`` does).
        optimizer: ``'sgd'``, ``'momentum'``, ``'adam'`` or ``'adamw'`` (its state per parameter).
        zero_grad: how ``.grad`` is cleared between steps: ``'set_to_none'`` (torch's default
            ``zero_grad()``) or ``'in_place'`` (``zero_grad(set_to_none=False)``, or gradients
            accumulated over several backwards). With ``'in_place'``, ``fxpipe.pipeline``'s one
            backward over every micro-batch holds a second copy of each stage's gradients while
            it runs (autograd sums the micro-batches' before adding into ``.grad``).
        device_flops, bandwidth: the device's peak (``790e12`` FLOP/s, ``'4.8TB/s'``): costs then
            come from shapes (a roofline), never from timing; required for a meta model.
        efficiency: share of that peak reached (default 1).
        balance_by: how each stage count is cut, as :func:`fxpipe.pipeline`'s (``'time'``,
            ``'memory'``, ``'params'``). Default: ``'time'`` for a model with weights (profiled, so
            two tunings on a busy machine may cut differently), ``'params'`` on meta.
        replicas: data-parallel replica counts ``dp`` to consider beside one pipeline over every
            device: ``dp`` replicas of a pipeline of ``N / dp`` devices, each on ``batch / dp``
            samples (``fxpipe.distributed`` on a ``('dp', 'pp')`` mesh), each with
            ``data_parallel='ddp'`` and, for the schedules ``fxpipe.distributed`` shards,
            ``'fsdp'`` (:mod:`fxpipe.tuning._data_parallel`, :mod:`fxpipe.tuning._sharded`);
            ``choice.kwargs['data_parallel']`` says which. Default: every ``dp`` dividing ``N`` and the
            batch that leaves 2 devices per pipeline or more; ``()``: none.
        loss_fn, target: the loss after the model, as for ``Pipeline.step``
            (``loss_fn(output, target)``, or ``loss_fn(output)`` without a target): timed on one
            micro-batch's output and counted in the last stage's forward and backward.

    Returns: a :class:`~fxpipe.tuning._result.Tuning`; ``print`` it, build ``tuning.best.pipeline()``.

    Raises:
        fxpipe.errors.MemoryBudgetError: nothing fits ``memory``; names the least requirement.
        fxpipe.errors.ArgumentError: a bad argument (named).
        and what :func:`fxpipe.pipeline` raises for a model it cannot capture.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    labels, torch_devices = _devices(devices)
    budget = parse_bytes(memory, "memory")
    flops = parse_rate(device_flops, "device_flops", "790e12")
    bw = parse_rate(bandwidth, "bandwidth", "4.8TB/s")
    if (flops is None) != (bw is None):
        raise ArgumentError("device_flops and bandwidth go together (the roofline needs both); pass both or neither",
                            argument="device_flops")
    for name in schedules:
        if name not in SCHEDULES:
            raise ArgumentError(f"schedules: unknown schedule {name!r}; the schedules are {', '.join(SCHEDULES)}",
                                argument="schedules")
    for mode in checkpoint:
        if mode not in CHECKPOINT_MODES:
            raise ArgumentError(f"checkpoint: unknown mode {mode!r}; the modes are {', '.join(CHECKPOINT_MODES)}",
                                argument="checkpoint")
    if balance_by is not None and balance_by not in BALANCE_BY:
        raise ArgumentError(f"balance_by must be one of {', '.join(map(repr, BALANCE_BY))} or None, got "
                            f"{balance_by!r}", argument="balance_by")
    if zero_grad not in ZERO_GRAD:
        raise ArgumentError(f"zero_grad must be one of {', '.join(map(repr, ZERO_GRAD))}, got {zero_grad!r}",
                            argument="zero_grad")
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}",
                            argument="optimizer")
    _check_timed_where_it_runs(model, torch_devices, flops)
    args = sample if isinstance(sample, tuple) else (sample,)
    kwargs = dict(sample_kwargs or {})
    options = BuildOptions(len(labels), 1, None, "params", leaf_modules, None, None, chunk_dims, output_merge,
                           as_progress(progress))
    with torch.inference_mode(False), preserved(model):
        checked = capture_and_check(model, args, kwargs, options)
    if checked.meta and flops is None:
        raise ArgumentError("a model on the meta device cannot be timed: pass device_flops= and bandwidth= (the "
                            "device's peak FLOP/s and memory bandwidth) so costs come from shapes",
                            argument="device_flops")
    if checked.meta and balance_by == "time":
        raise ArgumentError("balance_by='time' profiles the model, and a model on the meta device cannot run: "
                            "use balance_by='params' or 'memory'", argument="balance_by")
    flat = checked.capture.flatten_inputs(checked.args, checked.kwargs)
    size = batch if batch is not None else checked.batching.batch_size(flat)
    if not isinstance(size, int) or size < 1:
        raise ArgumentError(f"batch must be a positive integer, got {batch!r}", argument="batch")
    build: dict = {}  # what the choices' front doors need to build the same graph and batching
    if leaf_modules:
        build["leaf_modules"] = list(leaf_modules)
    if chunk_dims != 0:
        build["chunk_dims"] = chunk_dims
    if output_merge is not None:
        build["output_merge"] = output_merge
    skipped = {}
    for name in schedules:
        if name == "gpipe":
            continue
        if len(set(labels)) < len(labels):
            skipped[name] = "fxpipe.distributed runs one rank per device, and the devices given repeat"
        elif chunk_dims != 0:
            skipped[name] = (f"fxpipe.distributed cuts every input along dim 0 (chunk_dims={chunk_dims!r} is "
                             "fxpipe.pipeline's)")
    settings = Settings(labels, budget, size, list(schedules), list(checkpoint), _chunk_choices(size, chunks),
                        parse_rate(link, "link") or math.inf, parse_seconds(latency, "latency"), optimizer, flops, bw,
                        efficiency, torch_devices, skipped, balance_by, zero_grad,
                        send_overhead=parse_seconds(send_overhead, "send_overhead"), build=build,
                        loss_fn=loss_fn, target=target)
    search = Search(model, checked, settings, as_progress(progress))
    with torch.inference_mode(False):
        choices = search.run()
        if len(set(labels)) == len(labels) and any(name != "gpipe" for name in schedules):
            for dp in replica_counts(len(labels), size, replicas):
                if len(labels) % dp == 0 and size % dp == 0:
                    choices += replica_choices(model, checked, settings, dp, as_progress(progress), search)
            choices = ranked(choices)
    costs = "a roofline (device_flops, bandwidth)" if flops is not None else "each stage timed on one micro-batch"
    notes = [f"costs from {costs}; "
             f"memory: parameters + gradients + {optimizer} state + activations"
             + (" + receive buffers (distributed)" if any(c.distributed and c.peak_bytes for c in choices) else "")]
    shared = sorted({d for d in labels if labels.count(d) > 1})
    if shared:  # the peak of a device is that of all its stages together; on the CPU, of the process
        cpu = any(d.split(":")[0] == "cpu" for d in shared)
        notes.append(f"{' and '.join(shared)} given more than once: its stages share its memory, and 'per device' "
                     "is all of them together" + ("; for the CPU, the whole process" if cpu else ""))
    if len(set(labels)) > 1:  # sends between devices: what the user assumed, printed beside the times
        per_byte = f" + bytes / {settings.link / 1e9:.3g} GB/s" if math.isfinite(settings.link) else ""
        notes.append(f"a send between devices: {format_seconds(settings.latency)}{per_byte}, costing each of the "
                     f"two devices {format_seconds(settings.send_overhead)} of its own time (link, latency, "
                     "send_overhead)")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()) and any(
            c.chunks > 1 for c in choices):
        notes.append("BatchNorm in training mode normalises each micro-batch on its own statistics (GPipe's "
                     "semantics): with chunks > 1 the outputs differ from one whole-batch call "
                     "(docs/guide.md, BatchNorm)")
    notes += _timing_notes(search)
    if search.untimed:
        notes.append("stages the tuner could not time alone, predicted from the node profile instead (which "
                     f"leaves out what runs between nodes): {'; '.join(search.untimed[:3])}")
    if search.derived:
        notes.append(f"forwards recorded at micro-batch sizes {', '.join(map(str, sorted(search.recorded)))}; "
                     f"sizes {', '.join(map(str, sorted(search.derived)))} derived from them (every shape linear "
                     f"in the size, checked on the largest)")
    best = next((c for c in choices if c.fits), None)
    if best is not None and best.replicas > 1:
        notes.append(replicas_note(best, choices, settings.link))
    tuning = Tuning(choices, budget, model, sample, sample_kwargs, notes, skipped)
    for c in choices:
        c._tuning = tuning
    if not tuning.fitting:
        raise _nothing_fits(choices, budget, skipped)
    return tuning


def _timing_notes(search: Search) -> List[str]:
    """How far the stage timing moved between its interleaved rounds, and the loss's share."""
    notes = []
    if search.spreads:
        low, high = min(search.spreads.values()), max(search.spreads.values())
        notes.append(f"stage times: the fastest of 5 rounds, every micro-batch size timed in each; a round's total "
                     f"moved by {low:.0%}-{high:.0%} between rounds ((slowest - fastest) / median): what the "
                     "machine's load may move a predicted time by")
    if search.loss_s:
        size = max(search.loss_s)
        f, b = search.loss_s[size]
        notes.append(f"loss_fn timed and counted in the last stage: {format_seconds(f + b)} forward and backward "
                     f"at micro-batch {size}")
    return notes


def _nothing_fits(choices: List[Any], budget: Optional[float], skipped: dict) -> MemoryBudgetError:
    sized = [c for c in choices if c.peak_bytes]
    if not sized:
        whys = sorted({c.why for c in choices if c.why}) + [f"{name}: {why}" for name, why in sorted(skipped.items())]
        reasons = "; ".join(whys)[:600] or "no schedule, chunk count and checkpoint mode was given"
        return MemoryBudgetError(f"no configuration can run: {reasons}", budget=budget or 0.0)
    least = min(sized, key=lambda c: c.peak)
    device = max(least.peak_bytes, key=least.peak_bytes.__getitem__)
    return MemoryBudgetError(
        f"no configuration fits in memory={format_bytes(budget or 0)} per device: the smallest requirement is "
        f"{format_bytes(least.peak)} on device {device} (schedule {least.schedule!r}, {least.n_stages} stages, "
        f"chunks={least.chunks}, checkpoint={least.checkpoint!r}: parameters, gradients and optimizer state "
        f"{format_bytes(least.static_bytes[device])}, activations {format_bytes(least.activation_bytes[device])}). "
        "What to do: give more memory or more devices, a lighter optimizer (optimizer='sgd'), "
        "or a smaller batch", required=least.peak, budget=budget or 0.0)
