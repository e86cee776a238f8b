"""``data_parallel='fsdp'``: each replica's stages sharded over the replicas with FSDP2.

torch's ``fully_shard`` is applied to this rank's stage module over the replica group
(:mod:`._mesh`), after the build's fake metadata run. One stage per rank: a rank's two stages
(interleaved and V schedules) would be two FSDP roots, and FSDP's lazy initialisation refuses
that (measured: "FSDP requires a single root module"); the build refuses it first.

Between steps each rank holds ``1/dp`` of its stage's parameters, their gradients and the
optimizer state over them (DTensors sharded on dim 0). FSDP all-gathers the parameters at the
step's first forward (the stage module's forward hook) and keeps them whole, with the whole
gradients, until the reduce-scatter at the step's end, as for torch's own root FSDP module.

What makes it exact on the global batch, as with ``'ddp'`` (:mod:`._replicas`):

* the loss is weighed over the global batch (:mod:`._loss`), so the replicas' gradients are
  **summed**, not averaged: FSDP's gradient divide factor is set to 1, with plain sum
  reductions (gloo has no pre-multiplied sum);
* torch's ``PipelineStage`` keeps an FSDP submodule's gradients whole over the micro-batches
  and reduce-scatters them once, at the step's end (``perform_reduce_grad``), only when the
  stage module *is* the FSDP module; fxpipe's stages run inside their runners, so
  ``CheckpointedStage`` (:mod:`._build`) sets the same flags on the sharded stage before each
  backward and runs torch's reduction on it. (Without that, FSDP reduce-scattered after every
  micro-batch's backward: exact, and 1.9x torch's step, measured.)

The model keeps pointing at what the stages hold: torch.export's stages hold the model's
parameters in modules of their own, so each sharded parameter is also set where the model
held the original (``pipe.state_dict()`` then gives DTensors, which
``torch.distributed.checkpoint`` saves and loads across layouts).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["shard_stage", "local_part", "refuse_sharded_model", "sharded_stage"]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def sharded_stage(runner: nn.Module) -> object:
    """The FSDP-sharded stage module a runner (:class:`._values.StageRunner`) drives, or None."""
    from torch.distributed.fsdp import FSDPModule

    stage = getattr(runner, "stage", None)
    return stage if isinstance(stage, FSDPModule) else None


def refuse_sharded_model(model: nn.Module) -> None:
    """A model whose parameters an earlier ``'fsdp'`` pipeline sharded holds only this rank's
    slices (DTensors): no build can capture or run it whole. Refused, saying how to go on."""
    from torch.distributed.tensor import DTensor

    from fxpipe.errors import DistributedError

    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise DistributedError(
            f"the model's parameters ({sharded[0]!r} and {len(sharded) - 1} more) are the shards an earlier pipeline "
            "with data_parallel='fsdp' made (DTensors): each rank holds only its slice, so the model cannot be "
            "captured, run or built again. Save pipe.state_dict() with torch.distributed.checkpoint and build a "
            "fresh model (on meta) with state_dict=<that directory>")


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id of each parameter of ``model`` -> every (module, attribute) holding it."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((module, name))
    return found


def shard_stage(model: nn.Module, stage: nn.Module, replicas: object, device: torch.device) -> None:
    """``fully_shard`` on this rank's stage (one per rank: the build refuses more, they would
    be two FSDP roots) over the ``replicas`` process group; every place in ``model`` that held
    one of its parameters then holds the sharded one."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    holders = _holders(model)
    before = [(m, n, p) for m in stage.modules() for n, p in m._parameters.items() if p is not None]
    mesh = DeviceMesh.from_group(replicas, device.type)  # type: ignore[arg-type]
    # reshard_after_forward by default: not for a root, as in torch's own composition (its whole
    # parameters stay gathered from the step's first forward to the reduce-scatter at its end;
    # True re-gathered them for every micro-batch's backward: 1.16x torch's step, measured)
    fully_shard(stage, mesh=mesh)
    assert isinstance(stage, FSDPModule)
    stage.set_gradient_divide_factor(1.0)  # summed: the loss is weighed over the global batch
    stage.set_force_sum_reduction_for_comms(True)
    for module, name, original in before:
        sharded = module._parameters[name]
        for owner, attr in holders.get(id(original), ()):
            if owner._parameters.get(attr) is original:
                owner._parameters[attr] = sharded
