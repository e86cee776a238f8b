"""Static stage metadata from one fake run: shapes, dtypes and ``requires_grad`` per boundary.

torch's ``PipelineStage`` can infer its inputs and outputs by running every stage once on
uninitialised memory (its dynamic mode). Measured on torch 2.13 (issue 11) that corrupted
BatchNorm running statistics and fed an embedding out-of-range indices. fxpipe instead runs
all stages once under ``FakeTensorMode`` on a micro-batch-shaped sample: no real memory is
read or written, and the run yields each value crossing a boundary, from which
:func:`stage_metas` derives the static ``input_args`` / ``output_args`` (meta tensors carrying
the right ``requires_grad``) and the encoding of non-tensor values (:mod:`._values`).
Not quite no writes: an in-place op on a real buffer (BatchNorm's ``num_batches_tracked += 1``)
still lands, so callers run it inside :func:`fxpipe.capture._prepare.preserved`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ._values import Kind, kind_of, meta_of

__all__ = ["StageMeta", "stage_metas"]


@dataclass
class StageMeta:
    """What stage ``k`` receives and sends: kinds and meta tensors (``PipelineStage``'s
    ``input_args`` / ``output_args``)."""

    in_kinds: list[Kind]
    out_kinds: list[Kind]
    input_args: tuple[torch.Tensor, ...]
    output_args: tuple[torch.Tensor, ...]


def stage_metas(stages: Sequence[torch.fx.GraphModule], micro_flat: Sequence[Any],
                input_names: Sequence[Sequence[str]]) -> list[StageMeta]:
    """Runs ``stages`` in turn under ``FakeTensorMode`` on one micro-batch's flat inputs
    (``micro_flat``: the model's flat inputs, tensors cut to the micro-batch size) and
    returns each stage's :class:`StageMeta`. ``input_names[k]`` name stage ``k``'s values
    in errors."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        values = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in micro_flat]
        runs: list[tuple[list[Any], list[Any]]] = []
        for k, stage in enumerate(stages):
            out = list(stage(*values))
            runs.append((values, out))
            values = out
    metas = []
    for k, (ins, outs) in enumerate(runs):
        if k == 0:
            in_kinds: list[Kind] = ["tensor" if isinstance(v, torch.Tensor) else "none" for v in ins]
            in_args = [m for v in ins if isinstance(v, torch.Tensor) for m in meta_of(v, "tensor")]
        else:
            in_kinds = [kind_of(v, name) for v, name in zip(ins, input_names[k])]
            in_args = [m for v, kd in zip(ins, in_kinds) for m in meta_of(v, kd)]
        if k == len(stages) - 1:
            out_kinds: list[Kind] = []
            out_args = [m for v in outs if isinstance(v, torch.Tensor) for m in meta_of(v, "tensor")]
        else:
            out_kinds = [kind_of(v, name) for v, name in zip(outs, input_names[k + 1])]
            out_args = [m for v, kd in zip(outs, out_kinds) for m in meta_of(v, kd)]
        metas.append(StageMeta(in_kinds, out_kinds, tuple(in_args), tuple(out_args)))
    return metas
