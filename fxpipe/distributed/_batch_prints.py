"""What the ranks of one step must have been given alike, as numbers that travel in the step's
agreement (:meth:`._failures.Failures.agreed`): each rank's fingerprint of its batch, and the
refusals of ranks of one pipeline given different batches or replicas given the same one."""

from __future__ import annotations

from typing import Any, List

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import BatchMismatchError

from ._copies import as_integers

__all__ = ["PRINT", "fingerprint", "refuse_different_batches", "refuse_same_batches"]

#: numbers in a batch's fingerprint
PRINT = 3
_WEIGHTS: dict = {}  # (numel, device) -> the fixed weights of the second sum


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Fixed odd 32-bit weights, one per position (Knuth's multiplicative hash of the index),
    so two batches with the same values in another order (rows swapped between ranks' shards)
    weigh differently."""
    key = (n, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) > 16:
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = (torch.arange(n, dtype=torch.int64, device=device) * 2654435761 % 4294967296) | 1
    return w


def fingerprint(values: Any, device: torch.device) -> torch.Tensor:
    """Three int64 numbers that differ between two calls' tensors that differ (``values``: any
    structure of them), but by a rare accident: their element count, the sum of their bits and
    a sum of their bits weighted by position. Sums of integers wrap but never round, so every
    rank gets the same numbers for the same tensors whatever the order of the reduction (float
    sums could differ in their last bit with the memory's alignment). Computed where each tensor
    is (two numbers then moved to ``device``), without a sync: a few passes over the inputs and
    targets."""
    out = torch.zeros(PRINT, dtype=torch.int64, device=device)
    for t in pytree.tree_leaves(values):
        if not isinstance(t, torch.Tensor):
            continue
        x = as_integers(t).to(torch.int64)
        part = torch.stack([x.sum(), (x * _weights(x.numel(), x.device)).sum()])
        out[0] += x.numel()
        out[1:] += part.to(device, non_blocking=True)
    return out


def refuse_different_batches(prints: List[tuple], call: str, ranks: List[int]) -> None:
    """Every rank's fingerprint of its batch (all zeros: none given) the same, else
    :class:`BatchMismatchError` naming which ranks (``ranks``, of ``prints`` in order) got which batch."""
    given = [p for p in prints if any(p)]
    if len(set(given)) <= 1:
        return
    groups: dict = {}
    for rank, p in zip(ranks, prints):
        groups.setdefault(p, []).append(rank)
    listed = "; ".join(f"ranks {', '.join(map(str, g))}" if len(g) > 1 else f"rank {g[0]}" for g in groups.values())
    sizes = ""
    if len({p[0] for p in groups}) > 1:  # each fingerprint's first number counts the batch's elements
        sizes = "; their batches hold " + ", ".join(f"{p[0]} elements on rank{'s' if len(g) > 1 else ''} "
                                                    f"{', '.join(map(str, g))}" for p, g in groups.items()) \
            + ": another length or batch size"
    raise BatchMismatchError(
        f"the ranks were given different batches in {call or 'this call'} ({listed} each got another one{sizes}). "
        "A pipeline's first stage's rank reads the inputs and its last stage's rank the targets, so different "
        "batches would train one rank's inputs against another's targets. Nothing was sent. Pass the same batch "
        "(inputs and targets) on every rank of the pipeline: give them the same data loader order (the same seed, "
        "and a DistributedSampler over the data-parallel replicas only: num_replicas=pipe.dp_size, "
        "rank=pipe.dp_rank); batches of another length on one rank come from a loader that pads each rank's batch "
        "on its own.",
        groups=list(groups.values()))


def refuse_same_batches(prints: List[tuple], rows: List[List[int]]) -> None:
    """Replicas given the same batch in a step are refused: each would compute the same
    gradient, and the sum over replicas would train on ``dp`` copies of one shard."""
    if len(set(prints)) > 1 or not any(prints[0]):
        return
    raise BatchMismatchError(
        f"every one of the {len(prints)} data-parallel replicas was given the same batch in step(): the replicas would "
        "compute the same gradient, and their sum would train on that one batch counted once per replica, not on a "
        "global batch. Nothing was sent. Give each replica its own shard: pipe.shard(global_batch) on every rank, or "
        "DistributedSampler(dataset, num_replicas=pipe.dp_size, rank=pipe.dp_rank).",
        groups=[sorted(r for row in rows for r in row)])
