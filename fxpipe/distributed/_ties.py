"""Parameters used on several ranks (tied weights) get the gradient of the whole model.

Every rank holds the model, but only its stages use a parameter; a tied weight (a token
embedding reused as the LM head) is used by stages on two ranks, and each rank's autograd
sees only its own use. After each ``step`` the step's gradient of such a parameter is summed
over exactly the ranks that use it (``all_reduce`` on a subgroup), then added to what
``.grad`` held before the step, so gradient accumulation stays exact (summing the whole
accumulated ``.grad`` would count earlier steps once per rank). The subgroups are created
once, in the same order on every rank (``new_group`` is collective), when the pipeline is built.

Which parameters are tied is found by identity (:func:`tied_across_ranks`) before
``data_parallel='fsdp'`` shards the stages: sharding gives this rank's stages new parameter
objects, while the other ranks' stages, released here, keep the originals, so found after it a
tied weight looked used by one rank only, and its gradient was never summed (measured: a tied
GPT-2 trained to another loss from its second step on). :class:`TiedGradients` then finds each
by its name in the model, which holds the sharded one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._copies import Copies
from ._set_aside import SetAside
from ._sharding import local_part

__all__ = ["TiedGradients", "parameters_of", "ranks_using", "tied_across_ranks"]


def parameters_of(stage: nn.Module) -> list[nn.Parameter]:
    """The parameters a generated stage uses: the ones its GraphModule holds (emission copies
    into a stage only the submodules and attributes its code reads), the model's own objects."""
    return list(stage.parameters())


def ranks_using(stages: Sequence[nn.Module], placement: Sequence[int]) -> dict[int, set[int]]:
    """id of each parameter the stages use -> the ranks (``placement[k]``: stage ``k``'s) using it."""
    ranks: dict[int, set[int]] = {}
    for stage, rank in zip(stages, placement):
        for p in stage.parameters():
            ranks.setdefault(id(p), set()).add(rank)
    return ranks


def tied_across_ranks(model: nn.Module, stages: Sequence[nn.Module], placement: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The model's name of each parameter used by stages of more than one rank -> those
    pipeline ranks, in the model's order: the same on every rank. Called before anything
    replaces the stages' parameters (``'fsdp'``'s sharding)."""
    users = ranks_using(stages, placement)
    return {name: tuple(sorted(users[id(p)])) for name, p in model.named_parameters()
            if len(users.get(id(p), ())) > 1}


class TiedGradients:
    """The parameters of ``model`` used by stages of more than one rank, and their subgroups."""

    def __init__(self, model: nn.Module, tied: Mapping[str, Sequence[int]], rows: Sequence[Sequence[int]],
                 timeout: timedelta) -> None:
        """``tied``: :func:`tied_across_ranks`, found before the build replaced any parameter;
        ``rows``: the global ranks of each replica's pipeline, by pipeline position
        (:class:`._mesh.Layout`); one row without data parallel."""
        me = dist.get_rank()
        #: (model name, parameter, global ranks using it), in the model's order, for each replica
        self.tied: list[tuple[str, nn.Parameter, tuple[int, ...]]] = []
        for row in rows:
            for name, positions in tied.items():
                self.tied.append((name, model.get_parameter(name), tuple(row[k] for k in positions)))
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in sorted({r for _, _, r in self.tied}):  # the same order on every rank
            sub = dist.new_group(list(ranks), timeout=timeout)
            if me in ranks:
                self.groups[ranks] = sub
        self._aside = SetAside()

    def copies(self, group: dist.ProcessGroup) -> list[Copies]:
        """Every tied parameter as each call's agreement compares it (:mod:`._copies`), held on
        the ranks using it (their ranks in ``group``), the same list on every rank."""
        me = dist.get_rank()
        return [Copies(n, [(n, p)] if me in ranks else None, tuple(dist.get_group_rank(group, r) for r in ranks))
                for n, p, ranks in self.tied]

    def counted_here(self, p: nn.Parameter) -> bool:
        """Whether this rank counts ``p`` in a norm over all ranks: a tied parameter on the
        lowest rank holding it (its copies hold the same gradient after a step), any other
        parameter where it is."""
        me = dist.get_rank()
        for _, q, ranks in self.tied:
            if q is p and me in ranks:
                return me == ranks[0]
        return True

    def local(self) -> list[tuple[str, nn.Parameter, dist.ProcessGroup]]:
        return [(n, p, self.groups[r]) for n, p, r in self.tied if r in self.groups]

    def before_step(self) -> None:
        """Sets aside the gradient accumulated so far, so the step's own is what is summed."""
        self._aside.take(p for _, p, _ in self.local())

    def restore(self) -> None:
        """After a failed step: the gradients set aside go back, as they were."""
        self._aside.restore(p for _, p, _ in self.local())

    def after_step(self) -> None:
        """Sums the step's gradient over the ranks using each tied parameter, then adds back
        what was set aside. A parameter no rank got a gradient for keeps ``grad None``."""
        for _, p, group in self.local():
            g = p.grad
            step = torch.zeros_like(p) if g is None else g
            present = torch.tensor([0.0 if g is None else 1.0], device=p.device)  # NCCL: on the GPU
            dist.all_reduce(present, group=group)
            dist.all_reduce(local_part(step), group=group)  # 'fsdp': each copy holds the same shard
            if present.item() > 0:
                p.grad = step
            self._aside.add_back(p)
