"""Values crossing ranks as tensors: codecs, and the stage module torch's PipelineStage runs.

A ``PipelineStage`` boundary accepts tensors only ("All stage args must be tensors"), but an
fxpipe stage may hand the next one an ``int`` (``b, t, d = x.shape``), a ``torch.Size``, a
``bool``, ``None`` or a tuple of such values. Each crossing value gets a :data:`Kind` from
the fake run of the stages (:mod:`fxpipe.distributed._meta`), and travels as that kind's small
tensors (no grad): ``int`` -> int64 scalar, ``float`` -> float64 scalar (exact), ``bool`` ->
bool scalar, ``torch.Size`` -> int64 vector, ``None`` -> nothing, a tuple/list -> its items'
tensors in order. :class:`StageRunner` decodes its arguments, runs the generated stage and
encodes its results, so the generated code itself stays the one ``fxpipe.pipeline`` runs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.errors import DistributedError

from ._recompute import StageCheckpoint

__all__ = ["Kind", "kind_of", "encode", "decode", "meta_of", "StageRunner", "stage_runners"]

#: "tensor" | "int" | "float" | "bool" | "none" | "size" | ("tuple" | "list", [Kind, ...])
Kind = Union[str, tuple]

_SCALARS = {"int": torch.int64, "float": torch.float64, "bool": torch.bool}

_TENSOR = object()  # a tensor's place among the last stage's output leaves


def kind_of(value: Any, name: str) -> Kind:
    """The kind of a value crossing stages; :class:`DistributedError` for one that cannot cross."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.Size):
        return "size"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if value is None:
        return "none"
    if type(value) in (tuple, list):
        return (type(value).__name__, [kind_of(v, f"{name}[{i}]") for i, v in enumerate(value)])
    raise DistributedError(
        f"value {name!r} ({type(value).__name__}) crosses ranks between stages, and only tensors, ints, floats, "
        "bools, None, torch.Size and tuples/lists of them can (encoded as tensors). Return tensors from that "
        "part of the model, or move the cut: pass a plan= whose stages keep it inside one stage.")


def encode(value: Any, kind: Kind, device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """``value`` as the tensors that carry it, on ``device`` (the rank's: NCCL sends only
    CUDA tensors); contiguous, as the transport sends them (gloo refuses a strided tensor,
    "input tensor has to be contiguous": a transposed attention output crossing ranks in a
    Llama)."""
    if kind == "tensor":
        return [value.contiguous()]
    if kind == "none":
        return []
    if kind == "size":
        return [torch.tensor(list(value), dtype=torch.int64, device=device)]
    if isinstance(kind, str):
        return [torch.tensor(value, dtype=_SCALARS[kind], device=device)]
    return [t for v, k in zip(value, kind[1]) for t in encode(v, k, device)]


def decode(tensors: list[torch.Tensor], kind: Kind) -> Any:
    """The value ``encode`` made ``tensors`` from; consumes them from the front of the list."""
    if kind == "tensor":
        return tensors.pop(0)
    if kind == "none":
        return None
    if kind == "size":
        return torch.Size(tensors.pop(0).tolist())
    if isinstance(kind, str):
        return tensors.pop(0).item()
    items = [decode(tensors, k) for k in kind[1]]
    return tuple(items) if kind[0] == "tuple" else items


def meta_of(value: Any, kind: Kind) -> list[torch.Tensor]:
    """Meta tensors shaped like ``encode(value, kind)``, with the value's ``requires_grad``:
    the static ``input_args`` / ``output_args`` of a ``PipelineStage``."""
    if kind == "tensor":
        t = value
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return [meta.requires_grad_(t.requires_grad)]
    if kind == "none":
        return []
    if kind == "size":
        return [torch.empty((len(value),), dtype=torch.int64, device="meta")]
    if isinstance(kind, str):
        return [torch.empty((), dtype=_SCALARS[kind], device="meta")]
    return [t for v, k in zip(value, kind[1]) for t in meta_of(v, k)]


def _own(value: Any) -> Any:
    """A tensor that needs grad, or is a view, cloned: torch's zero-bubble schedules
    ``detach_()`` a stage's outputs after the input-gradient pass, which breaks a backward
    node that saved the output itself (``tanh``, ``sigmoid``) for the weight pass, and
    raises for a view (a carried value, a reshaped mask)."""
    if isinstance(value, torch.Tensor) and (value.requires_grad or value._is_view()):
        return value.clone()
    if type(value) in (tuple, list):
        return type(value)(_own(v) for v in value)
    return value


class StageRunner(nn.Module):
    """One generated stage as torch's ``PipelineStage`` runs it: tensors in, tensors out.

    ``inputs``: for the first stage, per flat model input either ``None`` (a tensor given to
    ``step``) or ``("const", value)`` (a non-tensor the graph specialised on); otherwise the
    kind of each boundary value received. ``outputs``: the kinds of the values sent, or
    ``None`` for the last stage, which returns the tensors among the model's output leaves:
    torch's schedules ``detach_()`` each output of the last stage after its backward, so a
    dict, a ``ModelOutput`` or an int there fails; :meth:`structured` rebuilds the model's
    own output structure (``out_spec``) for ``loss_fn`` and ``eval_step``.

    Checkpointing: micro-batches ``0 .. checkpoint_stop - 1`` (``micro_batch`` and ``index``,
    the stage's, are set by :class:`CheckpointedStage` before each forward) keep no
    activations; the stage is recomputed once for all the backward passes of the micro-batch,
    with the forward's RNG and autocast state and buffers (:mod:`._recompute`). Nothing is
    checkpointed in eval mode (``training_of.training`` false) or under no_grad.

    ``clone_outputs`` (zero-bubble schedules): every output tensor that needs grad or is a
    view is returned as a clone (:func:`_own`). ``device``: the rank's, where the encoded
    non-tensor values are made.
    """

    def __init__(self, stage: torch.fx.GraphModule, inputs: Sequence[Any], outputs: Sequence[Kind] | None,
                 first: bool, out_spec: pytree.TreeSpec | None = None, checkpoint_stop: int = 0,
                 training_of: nn.Module | None = None, clone_outputs: bool = False,
                 device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self.device = device
        self.stage = stage
        self.inputs = list(inputs)
        self.outputs = None if outputs is None else list(outputs)
        self.first = first
        self.out_spec = out_spec
        self.checkpoint_stop = checkpoint_stop
        self.micro_batch = 0
        self.index: Optional[int] = None  # the stage's, named in a recomputation's errors
        self.clone_outputs = clone_outputs
        self._leaves: list[Any] = []  # the last stage's output leaves, _TENSOR where a tensor was
        self._training_of = [training_of if training_of is not None else stage]  # not a submodule
        self._checkpoint = StageCheckpoint(stage, "a checkpointed stage")

    def _checkpointed(self) -> bool:
        return (self.micro_batch < self.checkpoint_stop and torch.is_grad_enabled()
                and self._training_of[0].training)

    def forward(self, *tensors: torch.Tensor) -> Any:
        pending = list(tensors)
        if self.first:
            args = [pending.pop(0) if slot is None else slot[1] for slot in self.inputs]
        else:
            args = [decode(pending, kind) for kind in self.inputs]
        if self._checkpointed():
            self._checkpoint.where = "a checkpointed stage" if self.index is None else f"stage {self.index}"
            out = self._checkpoint(*args)
        else:
            out = self.stage(*args)
        if self.clone_outputs:
            out = [_own(v) for v in out]
        if self.outputs is None:  # torch detaches each of the last stage's outputs: tensors only
            self._leaves = [_TENSOR if isinstance(v, torch.Tensor) else v for v in out]
            return tuple(v for v in out if isinstance(v, torch.Tensor))
        return tuple(t for v, k in zip(out, self.outputs) for t in encode(v, k, self.device))

    def flat(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The last stage's flat output leaves: ``tensors`` with the other leaves of the
        latest forward."""
        pending = list(tensors)
        return [pending.pop(0) if v is _TENSOR else v for v in self._leaves]

    def structured(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The last stage's output tensors (one micro-batch's, or merged by ``eval_step``) in
        the model's output structure, with the other leaves of the latest forward."""
        return pytree.tree_unflatten(self.flat(tensors), self.out_spec)


def stage_runners(stages: Any, metas: Sequence[Any], flat: Sequence[Any], local: Sequence[int], out_spec: Any,
                  device: torch.device, group: Any, stage_class: type, **options: Any) -> tuple[list[Any], dict]:
    """This rank's stages ``local`` (of the emitted ``stages``) as ``stage_class`` pipeline
    stages (torch's ``PipelineStage`` or a subclass) around :class:`StageRunner`\\ s, with the
    static boundary metadata ``metas`` (:mod:`._meta`); the first stage takes the model's flat
    inputs ``flat`` (non-tensors as constants). ``options``: the runners' keywords. Returns the
    pipeline stages and ``{stage index: runner}``."""
    n_stages = len(stages)
    pipe_stages, runners = [], {}
    for k in local:
        first, last = k == 0, k == n_stages - 1
        inputs = [None if isinstance(v, torch.Tensor) else ("const", v) for v in flat] if first else metas[k].in_kinds
        runners[k] = StageRunner(stages[k], inputs, None if last else metas[k].out_kinds, first, out_spec,
                                 device=device, **options)
        pipe_stages.append(stage_class(runners[k], k, n_stages, device, input_args=metas[k].input_args,
                                       output_args=metas[k].output_args, group=group))
    return pipe_stages, runners
