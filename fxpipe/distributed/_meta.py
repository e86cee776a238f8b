"""Static stage metadata from one fake run: shapes, dtypes and ``requires_grad`` per boundary.

torch's ``PipelineStage`` can infer its inputs and outputs by running every stage once on
uninitialised memory (its dynamic mode). Measured on torch 2.13 (issue 11) that corrupted
BatchNorm running statistics and fed an embedding out-of-range indices. fxpipe instead runs
all stages once under ``FakeTensorMode`` on a micro-batch-shaped sample: no real memory is
read or written, and the run yields each value crossing a boundary, from which
:func:`stage_metas` derives the static ``input_args`` / ``output_args`` (meta tensors carrying
the right ``requires_grad``) and the encoding of non-tensor values (:mod:`._values`).

The fake run happens on the rank's device: every tensor the stages hold (parameters, buffers,
constants) is swapped, for the run only, for a fake of its shape and dtype on that device, and
so are the inputs. Autocast picks dtypes per device type (a CUDA autocast region leaves a
CPU matmul in float32), so metadata found on another device would size the buffers the ranks
exchange with the wrong dtype. Stages of other ranks, whose weights stay on the CPU or on meta,
run on the device too, for free. The swap also keeps the run from writing real buffers
(BatchNorm's ``num_batches_tracked += 1`` lands on the fake).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ._values import Kind, kind_of, meta_of

__all__ = ["StageMeta", "stage_metas", "stage_runs", "fake_of", "fake_runs", "metas_of", "on_device", "uncompiled", "unhooked"]


@dataclass
class StageMeta:
    """What stage ``k`` receives and sends: kinds and meta tensors (``PipelineStage``'s
    ``input_args`` / ``output_args``)."""

    in_kinds: list[Kind]
    out_kinds: list[Kind]
    input_args: tuple[torch.Tensor, ...]
    output_args: tuple[torch.Tensor, ...]
    #: the last stage's flat outputs of one micro-batch (meta tensors, other values as they
    #: are): what ``loss_fn`` is read on before a step sends anything (:mod:`fxpipe.checks._loss_fn`)
    outputs: tuple[Any, ...] = ()


def fake_of(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake of ``t`` on ``device`` (made inside the fake mode): same shape, strides, dtype,
    ``requires_grad``, and class for a Parameter."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else fake


@contextmanager
def on_device(stages: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Every tensor the stages' modules hold -- ``_parameters``, ``_buffers`` and plain tensor
    attributes -- replaced by a fake on ``device`` (one fake per tensor object, so tied weights
    stay tied), and put back afterwards. Call inside the fake mode."""
    fakes: dict[int, torch.Tensor] = {}
    undo: list[tuple[Any, str, Any]] = []  # (dict, key, original value)
    seen: set[int] = set()
    try:
        for stage in stages:
            for module in stage.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for table in (module._parameters, module._buffers, module.__dict__):
                    for key, value in list(table.items()):
                        if isinstance(value, torch.Tensor):
                            fake = fakes.get(id(value))
                            if fake is None:
                                fake = fakes[id(value)] = fake_of(value, device)
                            undo.append((table, key, value))
                            table[key] = fake
        yield
    finally:
        for table, key, value in reversed(undo):
            table[key] = value


def unhooked(stage: nn.Module) -> Any:
    """The stage's call for a fake run: its ``forward`` alone for a stage FSDP shards, whose
    hooks would all-gather real parameters (the fakes stand in for them, whole)."""
    from torch.distributed.fsdp import FSDPModule

    return stage.forward if isinstance(stage, FSDPModule) else stage


@contextmanager
def uncompiled(stages: Sequence[nn.Module]) -> Iterator[None]:
    """The stages' own code for the block, not their ``stage.compile()``-d forward: a new
    shape's metadata run comes after the build compiled them, and a compiled forward would be
    traced again under the fake mode for one fake run (``nn.Module.compile`` keeps the
    compiled call in ``_compiled_call_impl``)."""
    kept = [(stage, stage._compiled_call_impl) for stage in stages]
    try:
        for stage, _ in kept:
            stage._compiled_call_impl = None
        yield
    finally:
        for stage, call in kept:
            stage._compiled_call_impl = call


def stage_metas(stages: Sequence[torch.fx.GraphModule], micro_flat: Sequence[Any],
                input_names: Sequence[Sequence[str]], device: torch.device) -> list[StageMeta]:
    """Runs ``stages`` in turn under ``FakeTensorMode`` on ``device``, on one micro-batch's
    flat inputs (``micro_flat``: the model's flat inputs, tensors cut to the micro-batch size),
    and returns each stage's :class:`StageMeta`. ``input_names[k]`` name stage ``k``'s values
    in errors."""
    return metas_of(stage_runs(stages, micro_flat, device), input_names)


Runs = list[tuple[list[Any], list[Any]]]


def stage_runs(stages: Sequence[torch.fx.GraphModule], micro_flat: Sequence[Any], device: torch.device) -> Runs:
    """Each stage's fake inputs and outputs, the stages run in turn on fakes of ``micro_flat``."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        values = [fake_of(x, device) if isinstance(x, torch.Tensor) else x for x in micro_flat]
        return fake_runs(stages, values, device, mode)


def fake_runs(stages: Sequence[torch.fx.GraphModule], values: list[Any], device: torch.device, mode: Any) -> Runs:
    """Each stage's fake inputs and outputs, the stages run in turn on ``values`` (fakes of
    ``mode``) with their own tensors swapped for fakes on ``device``."""
    with mode, on_device(stages, device), uncompiled(stages):
        runs: Runs = []
        for stage in stages:
            out = list(unhooked(stage)(*values))
            runs.append((values, out))
            values = out
    return runs


def metas_of(runs: Runs, input_names: Sequence[Sequence[str]]) -> list[StageMeta]:
    """The :class:`StageMeta` of each stage from its run's inputs and outputs."""
    metas = []
    for k, (ins, outs) in enumerate(runs):
        if k == 0:
            in_kinds: list[Kind] = ["tensor" if isinstance(v, torch.Tensor) else "none" for v in ins]
            in_args = [m for v in ins if isinstance(v, torch.Tensor) for m in meta_of(v, "tensor")]
        else:
            in_kinds = [kind_of(v, name) for v, name in zip(ins, input_names[k])]
            in_args = [m for v, kd in zip(ins, in_kinds) for m in meta_of(v, kd)]
        outputs: tuple[Any, ...] = ()
        if k == len(runs) - 1:
            out_kinds: list[Kind] = []
            out_args = [m for v in outs if isinstance(v, torch.Tensor) for m in meta_of(v, "tensor")]
            outputs = tuple(torch.empty(v.shape, dtype=v.dtype, device="meta", requires_grad=v.requires_grad)
                            if isinstance(v, torch.Tensor) else v for v in outs)
        else:
            out_kinds = [kind_of(v, name) for v, name in zip(outs, input_names[k + 1])]
            out_args = [m for v, kd in zip(outs, out_kinds) for m in meta_of(v, kd)]
        metas.append(StageMeta(in_kinds, out_kinds, tuple(in_args), tuple(out_args), outputs))
    return metas
