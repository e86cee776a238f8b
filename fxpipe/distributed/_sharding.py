"""``data_parallel='fsdp'``: each replica's stages sharded over the replicas with FSDP2.

torch's ``fully_shard`` is applied to each of this rank's stage modules over the replica group
(:mod:`._mesh`), after the build's fake metadata run: one FSDP root per stage, two on a rank of
the interleaved and V schedules (one ``fully_shard`` over both would be one root of two
modules, which FSDP's lazy initialisation refuses: "requires a single root module", measured).

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

A weight tied across pipeline ranks is sharded on each rank using it (each holds the same
shard) and its gradient summed over those ranks (:mod:`._ties`); one two stages of a rank share
is left whole (:func:`shard_stages`).
"""

from __future__ import annotations

from typing import Hashable, Iterable, Tuple

import torch
from torch import nn

#: set in the ``__dict__`` of a parameter :func:`shard_stages` replaced by its shard: its model
#: name (an optimizer made over it before the build would update nothing: refused at its step)
SHARDED_AWAY = "_fxpipe_sharded_away"

__all__ = ["SHARDED_AWAY", "shard_stages", "sharded_here", "is_sharded", "placed_like", "local_part",
           "refuse_sharded_model", "sharded_stage", "used_twice_on_a_rank"]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def placed_like(value: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``value`` as ``t`` holds it: a whole tensor cut to this rank's shard when ``t`` is a
    DTensor (each rank keeps its own slice, nothing sent)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(t, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
    return value


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor: a shard FSDP made, which no other replica holds a copy of."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


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


def shared_on_a_rank(stages: list[nn.Module], placement: list[int]) -> set[nn.Parameter]:
    """The parameters two stages of one rank both use (a tied embedding and LM head that a V
    schedule puts on one rank), over every rank's stages: the same set on every rank, so a
    weight also tied to another rank's stage is whole on all of them."""
    found = {id(p): p for stage in stages for p in stage.parameters()}
    uses = ((rank, {id(p) for p in stage.parameters()}) for stage, rank in zip(stages, placement))
    return {found[i] for i in used_twice_on_a_rank(uses)}


def used_twice_on_a_rank(uses: Iterable[Tuple[Hashable, Iterable[Hashable]]]) -> set:
    """The keys two stages placed on one rank both hold, from ``(rank, the stage's keys, each
    once)`` per stage: the weights :func:`shard_stages` leaves whole. ``fxpipe.tune`` predicts
    'fsdp' from the same decision, on its stages' tensors (:mod:`fxpipe.tuning._data_parallel`)."""
    counts: dict = {}
    for rank, keys in uses:
        for key in keys:
            counts[(rank, key)] = counts.get((rank, key), 0) + 1
    return {key for (_, key), n in counts.items() if n > 1}


def sharded_here(stages: list[nn.Module], placement: list[int], local: list[int]) -> set[int]:
    """The ids of the parameters :func:`shard_stages` shards on this rank: its stages' (``local``),
    less those two stages of one rank share."""
    shared = {id(p) for p in shared_on_a_rank(stages, placement)}
    return {id(p) for k in local for p in stages[k].parameters() if id(p) not in shared}


def shard_stages(model: nn.Module, stages: list[nn.Module], placement: list[int], local: list[int],
                 replicas: object, device: torch.device) -> None:
    """``fully_shard`` on each of this rank's stages (``local``, of all ``stages`` placed on
    ranks by ``placement``) over the ``replicas`` process group, each its own FSDP root (as
    torchtitan shards each of a rank's pipeline stages); every place in ``model`` that held one
    of their parameters then holds the sharded one.

    A parameter two stages of one rank share is left whole on every replica (FSDP's
    ``ignored_params``): two roots would shard it twice, into two parameters with two gradients.
    Its gradient is summed over the replicas with the unsharded ones (:mod:`._replicas`), and its
    copies are compared at each call (:mod:`._copies`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    holders = _holders(model)
    names = {id(p): n for n, p in model.named_parameters()}
    shared = shared_on_a_rank(stages, placement)
    stages = [stages[k] for k in local]
    before = [(m, n, p) for stage in stages for m in stage.modules() for n, p in m._parameters.items()
              if p is not None and p not in shared]
    # named after its group: torch compares meshes by ranks and names, not groups, and its DTensor
    # caches then gave a later pipeline's gradients an earlier pipeline's (destroyed) group (measured:
    # full_tensor() raised "Could not resolve the process group")
    name = f"dp_{replicas.group_name}"  # type: ignore[attr-defined]
    mesh = DeviceMesh.from_group(replicas, device.type, mesh_dim_names=(name,))  # type: ignore[arg-type]
    for stage in stages:
        # reshard_after_forward by default: not for a root, as in torch's own composition (its whole
        # parameters stay gathered from the step's first forward to the reduce-scatter at its end;
        # True re-gathered them for every micro-batch's backward: 1.16x torch's step, measured)
        fully_shard(stage, mesh=mesh, ignored_params=shared or None)
        assert isinstance(stage, FSDPModule)
        stage.set_gradient_divide_factor(1.0)  # summed: the loss is weighed over the global batch
        stage.set_force_sum_reduction_for_comms(True)
    for module, name, original in before:
        sharded = module._parameters[name]
        if sharded is not original:
            original.__dict__[SHARDED_AWAY] = names.get(id(original), name)
        for owner, attr in holders.get(id(original), ()):
            if owner._parameters.get(attr) is original:
                owner._parameters[attr] = sharded
