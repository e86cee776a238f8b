"""Where each rank stands: one pipeline over every rank, or pipelines side by side on a mesh.

Without a mesh, ``fxpipe.distributed`` runs one pipeline over the whole job, as before. With
``mesh=`` (a ``torch.distributed.device_mesh.DeviceMesh`` with dims named ``'pp'`` and
``'dp'``), the job runs ``dp`` copies of one pipeline of ``pp`` ranks, each copy (replica) on
its own shard of the global batch, their gradients summed once per step
(:mod:`._replicas`). :class:`Layout` names the groups each decision needs:

* ``pipe``: this rank's pipeline (a row of the mesh); torch's ``PipelineStage``s send over it,
  the loss is broadcast over it, a tied weight's gradient is summed in it, clipping's norm is
  summed over it (the replicas hold equal gradients after the step).
* ``replicas``: the ranks running this rank's stages in the other replicas (a column); the
  step's gradients, the loss's counts and the loss are summed over it.
* ``world``: every rank of the mesh. The build's agreements (the plan, the stage code, the
  weights broadcast from rank 0) and each call's agreement (a failure on any rank named on
  every rank, the batches checked) run over it, so every replica runs the same plan from the
  same weights, and one replica's failure stops every replica.

The groups are made here (``new_group`` with the pipeline's ``timeout``), not taken from the
mesh, whose groups keep the default timeout: a rank waits ``timeout`` and no longer. The mesh
must span every rank of the job (a rank left out would not take part in ``new_group``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["Layout", "layout_of", "DATA_PARALLEL", "refuse_replicated_state", "shard"]

#: what ``data_parallel=`` takes
DATA_PARALLEL = (None, "ddp", "fsdp")


@dataclass
class Layout:
    """The process groups of one rank (see the module docstring); ranks are global."""

    world: dist.ProcessGroup
    pipe: dist.ProcessGroup
    replicas: Optional[dist.ProcessGroup]  # None: one replica
    rows: list[list[int]]  # rows[i][k]: the rank at pipeline position k of replica i
    replica: int  # this rank's replica (its row)
    data_parallel: Optional[str]

    @property
    def dp(self) -> int:
        return len(self.rows)

    @property
    def pp(self) -> int:
        return len(self.rows[0])

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank belongs to, each once (to destroy when the pipeline closes)."""
        pipe = self.pipe if self.pipe is not self.world else None  # one replica: the pipeline is the world
        return [g for g in (self.world, pipe, self.replicas) if g is not None]


def _new_groups(rank_lists: list[list[int]], wait: timedelta) -> list[dist.ProcessGroup]:
    """One group per list, made on every rank in the same order (``new_group`` is collective)."""
    return [dist.new_group(ranks, timeout=wait) for ranks in rank_lists]


def _mesh_rows(mesh: Any) -> list[list[int]]:
    """The mesh's ranks as rows of one pipeline each (``dp x pp``), checked."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh with dims named 'pp' (and 'dp'), "
                        f"got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or set(names) - {"pp", "dp"} or len(names) != mesh.mesh.dim():
        raise ValueError(
            f"mesh must have a dim named 'pp' (the pipeline) and may have one named 'dp' (data parallel), and no "
            f"other, got mesh_dim_names={names or None}: make it with init_device_mesh(device_type, (dp, pp), "
            "mesh_dim_names=('dp', 'pp'))")
    ranks = mesh.mesh
    if "dp" in names:
        ranks = ranks.permute(names.index("dp"), names.index("pp"))
    else:
        ranks = ranks.unsqueeze(0)
    rows = ranks.reshape(-1, ranks.shape[-1]).tolist()
    world = dist.get_world_size()
    if sorted(r for row in rows for r in row) != list(range(world)):
        raise ValueError(f"mesh must span every rank of the job ({world} ranks), got ranks {sorted(sum(rows, []))}: "
                         "start the job with as many ranks as the mesh holds")
    return rows


def layout_of(mesh: Any, data_parallel: Optional[str], wait: timedelta) -> Layout:
    """The groups of this rank; collective over the whole job."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if mesh is None:
        if data_parallel is not None:
            raise ValueError(f"data_parallel={data_parallel!r} needs mesh= (a DeviceMesh with dims 'dp' and 'pp'): "
                             "without one the pipeline spans every rank and there are no replicas")
        rows = [list(range(dist.get_world_size()))]
    else:
        rows = _mesh_rows(mesh)
        if len(rows) > 1 and data_parallel is None:
            raise ValueError(
                f"the mesh has {len(rows)} replicas along 'dp', and data_parallel=None runs none: pass "
                "data_parallel='ddp' (each replica whole, the step's gradients summed over the replicas once per step) "
                "or 'fsdp' (each replica's stages sharded over the replicas)")
    me = dist.get_rank()
    replica = next(i for i, row in enumerate(rows) if me in row)
    everyone = list(range(dist.get_world_size()))
    world = _new_groups([everyone], wait)[0]
    pipes = _new_groups(rows, wait) if len(rows) > 1 else [world]
    columns = [[row[k] for row in rows] for k in range(len(rows[0]))]
    replicas = _new_groups(columns, wait) if len(rows) > 1 else [None] * len(columns)
    return Layout(world, pipes[replica], replicas[rows[replica].index(me)], rows, replica,
                  data_parallel if len(rows) > 1 else None)


def shard(value: Any, layout: Layout) -> Any:
    """This replica's contiguous share of a global batch (every tensor split along dim 0 into
    ``dp`` equal parts; anything else as it is)."""
    import torch.utils._pytree as pytree

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % layout.dp:
            from fxpipe.errors import BatchShapeError

            raise BatchShapeError(f"a global batch of {t.shape[0]} samples does not split into {layout.dp} equal "
                                  f"replica shares: pass a multiple of {layout.dp} (times chunks), or give each "
                                  "replica its own share (a smaller last share runs: pipe.step(x_of_this_replica))")
        n = t.shape[0] // layout.dp
        return t[layout.replica * n:(layout.replica + 1) * n]

    return pytree.tree_map(cut, value)


def refuse_replicated_state(updated: list[str], layout: Layout) -> None:
    """Buffers the forward updates (BatchNorm's running statistics, a step counter) would
    drift apart on the replicas, each updating its own copy from its own shard: no replica's,
    nor their mean, is what one process on the global batch computes. Refused at the build
    (the same model on every rank: the same refusal everywhere), naming them."""
    if layout.dp < 2 or not updated:
        return
    from fxpipe.errors import MutationError

    shown = ", ".join(map(repr, updated[:4])) + (f" and {len(updated) - 4} more" if len(updated) > 4 else "")
    raise MutationError(
        f"the model updates buffers in its forward ({shown}), and with data_parallel={layout.data_parallel!r} each of "
        f"the {layout.dp} replicas would update its own copy from its own shard: the copies would drift apart, and "
        "none would hold what one process computes on the global batch. Replace BatchNorm with a norm that keeps no "
        "running statistics (LayerNorm, GroupNorm), freeze those modules in eval mode before the build, or run one "
        "pipeline without replicas (mesh=None)")
