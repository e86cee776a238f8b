"""Weights that several ranks each hold a copy of, compared before each call.

Two kinds of copies must hold the same bits at every ``step`` and ``eval_step``, or the ranks
train different models while every number they print looks right:

* **a tied parameter** (an embedding reused as the LM head) on the ranks whose stages use it
  (:mod:`._ties`): its copies drift when each rank clips by its own norm, or when an optimizer's
  update of one parameter reads others;
* **what the replicas hold whole** (:mod:`._replicas`): under ``data_parallel='ddp'`` every
  replica holds whole copies of the same stages; under ``'fsdp'`` its buffers and a weight two
  stages of one rank share (the rest are shards, one per replica, no copies). They drift when
  weights are loaded on one replica only (``if pipe.dp_rank == 0: pipe.load_state_dict(...)``),
  when an optimizer is stepped or built differently on one replica, or when a weight is changed
  by hand on one rank. The summed gradients then update different weights, the replicas stop
  computing one model's gradient, and nothing raised.

Each rank adds one number per copy it holds to the call's agreement (:meth:`._failures.Failures.agreed`,
the same all-reduce that carries the batches' fingerprints): the sum of the copy's bits as
integers, which wraps but never rounds, so equal copies give equal numbers whatever the order
of the reduction. A replica's stage counts as one number, the sum over all its tensors: ``pp``
numbers per rank whatever the model's size. When they differ, the ranks holding that stage find
which tensor differs (one ``all_gather`` over the replicas, only then), and every rank raises
the same typed error, before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from fxpipe.errors import ReplicaWeightsError, TiedWeightsError

from ._sharding import local_part

__all__ = ["Copies", "bits_sum", "as_integers", "refuse_different_copies", "replica_copies"]

#: the integer type of each element size: a float's bits are summed as an integer
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_integers(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers, flat: a float's (or a complex part's) bits, a bool as 0 or 1."""
    x = local_part(t.detach()).reshape(-1)  # a DTensor ('fsdp'): the shard this rank holds
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_floating_point():
        x = x.view(_BITS[x.element_size()])
    return x


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's bits as int64: equal for equal tensors whatever the reduction
    order, different (but by a rare accident) for tensors that differ; one pass."""
    return as_integers(t).sum(dtype=torch.int64)


@dataclass(frozen=True)
class Copies:
    """Tensors that the ranks ``ranks`` (in the agreement's group) each hold a copy of. The
    same list of these, in the same order, is given on every rank."""

    name: str  # what they are, in the error: a parameter's name, or "the stages at pipeline position k"
    held: Optional[Sequence[tuple[str, torch.Tensor]]]  # this rank's copy (named tensors); None: holds none
    ranks: tuple[int, ...]
    replicas: Optional[dist.ProcessGroup] = None  # a replica's stages: the ranks holding them (else a tied weight)

    def bits(self) -> torch.Tensor:
        """One number for this rank's copy: the sum of its tensors' bit sums (wrapping)."""
        if not self.held:
            return torch.zeros((), dtype=torch.int64)
        return torch.stack([bits_sum(t) for _, t in self.held]).sum()


def replica_copies(named: Sequence[tuple[str, torch.Tensor]], rows: Sequence[Sequence[int]], position: int,
                   world: dist.ProcessGroup, replicas: Optional[dist.ProcessGroup]) -> List[Copies]:
    """The copies the replicas hold: one :class:`Copies` per pipeline position, held by the
    ranks of that column of ``rows``; ``named``: the tensors of this rank's stages (at
    ``position``) that each replica holds whole, by the model's names. None without replicas."""
    if replicas is None or len(rows) < 2:
        return []
    out = []
    for at in range(len(rows[0])):
        ranks = tuple(dist.get_group_rank(world, row[at]) for row in rows)
        out.append(Copies(f"the weights of pipeline position {at}", list(named) if at == position else None,
                          ranks, replicas))
    return out


def refuse_different_copies(copies: Sequence[Copies], held: List[int], world: int) -> None:
    """Every copy holds the same bits (``held[i * world + r]``: copy ``i``'s number on rank
    ``r``), else a typed error naming the first that does not, on every rank (all see the same
    reduced numbers)."""
    for i, copy in enumerate(copies):
        sums = {r: held[i * world + r] for r in copy.ranks}
        if len(set(sums.values())) <= 1:
            continue
        if copy.replicas is not None:
            _refuse_replicas(copy, sums)
        raise TiedWeightsError(
            f"the tied parameter {copy.name!r} holds other values on ranks {', '.join(map(str, copy.ranks))} at the "
            "start of this step: its copies were updated differently, and the step would train two different weights. "
            "Likely causes: torch.nn.utils.clip_grad_norm_ on each rank, which clips by that rank's own norm (use "
            "pipe.clip_grad_norm_(max_norm), the global norm); an optimizer whose update of one parameter reads "
            "others (a global norm or trust ratio over its whole param group); weights loaded or changed on one "
            "rank only. Optimizers that update each parameter from its own value, gradient and state (SGD, Adam, "
            "AdamW, with weight decay) keep the copies equal. Nothing was sent; reload the weights on every rank "
            "(or build the pipeline again) to go on.", parameter=copy.name, ranks=copy.ranks)


def _refuse_replicas(copy: Copies, sums: dict[int, int]) -> None:
    groups: dict[int, list[int]] = {}
    for r, s in sums.items():
        groups.setdefault(s, []).append(r)
    listed = "; ".join(f"rank{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}" for g in groups.values())
    tensor = _first_different(copy) if copy.held is not None else ""
    which = f" ({tensor!r} first)" if tensor else ""
    raise ReplicaWeightsError(
        f"{copy.name}{which} differ between the data-parallel replicas ({listed} each hold other values) at the start "
        "of this call: the replicas would sum gradients of different models, and each would step its own weights "
        "with them. Likely causes: weights loaded on one replica only (call pipe.load_state_dict, or "
        "torch.distributed.checkpoint's load, on every rank), an optimizer built or stepped on some ranks only, a "
        "weight changed by hand on one rank. Nothing was sent; load the same weights on every rank (or build the "
        "pipeline again) to go on.", parameter=tensor, ranks=tuple(copy.ranks))


def _first_different(copy: Copies) -> str:
    """The first of this rank's tensors whose bits differ between the replicas (collective over
    them: every rank holding the copy calls it, the others do not)."""
    assert copy.held is not None and copy.replicas is not None
    mine = torch.stack([bits_sum(t).cpu() for _, t in copy.held]) if copy.held else torch.zeros(0, dtype=torch.int64)
    device = copy.held[0][1].device if copy.held else torch.device("cpu")
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(copy.replicas))]
    dist.all_gather(everyone, mine.to(device), group=copy.replicas)
    table = torch.stack([t.cpu() for t in everyone])
    differ = (table != table[0]).any(dim=0).nonzero()
    return copy.held[int(differ[0])][0] if len(differ) else ""

