"""One plan for every rank: rank 0 plans and broadcasts it; every rank checks its stage code.

Ranks that profile on their own make different plans (three ranks gave three plans for a tied
GPT, issue 11), and ranks whose stages differ would exchange buffers of the wrong size or
deadlock. So rank 0 alone plans (or loads ``plan=``) and broadcasts the plan as JSON -- or,
when planning failed, its error, so the other ranks raise too instead of waiting -- and every
rank emits all stages from it and compares the hash of each stage's code with every other
rank's (:class:`~fxpipe.errors.PlanMismatchError` on every rank when they differ: different
models, or different fxpipe/torch versions). :func:`on_every_rank` is the rule behind both
checks, also used for loading weights: a step that fails on one rank fails on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence, TypeVar

import torch.distributed as dist

from fxpipe.errors import DistributedError, PeerFailedError, PlanMismatchError
from fxpipe.plan._value import Plan

__all__ = ["broadcast_plan", "agree_on_stages", "agree_on_arguments", "on_every_rank", "code_hash"]

T = TypeVar("T")


def broadcast_plan(make: Optional[Callable[[], Plan]], group: dist.ProcessGroup) -> Plan:
    """``make()`` on the group's rank 0 (``make`` is ignored elsewhere), the result on every rank."""
    box: list[object] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("plan", make().to_json())  # type: ignore[misc]
        except BaseException as e:  # every rank must hear about it, then rank 0 re-raises
            box[0] = ("error", f"{type(e).__name__}: {e}")
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            raise
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    tag, text = box[0]  # type: ignore[misc]
    if tag == "error":
        raise PeerFailedError(f"rank 0 could not make the plan, so there is none to run: {text}", 0, f"rank 0: {text}")
    return Plan.from_json(text)


def code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def on_every_rank(fn: Callable[[], T], group: dist.ProcessGroup, doing: str, advice: str) -> list[T]:
    """Runs ``fn()`` on this rank and returns every rank's result, in rank order.

    When ``fn`` raised on some rank, no rank goes on to a later collective (where it would
    wait for the failed one until the timeout): the failed rank re-raises its own error and
    every other rank raises :class:`PeerFailedError` naming it, ``doing`` what, and ``advice``.
    """
    failure: Optional[BaseException] = None
    try:
        mine: tuple[str, object] = ("ok", fn())
    except Exception as e:  # reported to every rank below, then re-raised here
        failure, mine = e, ("error", f"{type(e).__name__}: {e}")
    every: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if failure is not None:
        raise failure
    failed = [(r, text) for r, (tag, text) in enumerate(every) if tag == "error"]  # type: ignore[misc]
    if failed:
        r, text = failed[0]
        raise PeerFailedError(f"rank {r} could not {doing} ({text}); {advice}", r, f"rank {r}: {text}")
    return [value for _, value in every]  # type: ignore[misc]


def agree_on_stages(build: Callable[[], Sequence[str]], group: dist.ProcessGroup) -> None:
    """Runs ``build()`` (this rank's checks and emission, returning every stage's code) and
    makes every rank agree on the outcome: a rank whose build raised re-raises its error and
    every other rank raises :class:`PeerFailedError` naming it (no rank is left waiting);
    ranks whose code differs raise :class:`PlanMismatchError` on every rank."""
    every = on_every_rank(lambda: [code_hash(c) for c in build()], group, "build its pipeline",
                          "every rank must build the same model with the same arguments")
    mine = every[dist.get_rank(group)]
    if any(h != mine for h in every):
        listing = "; ".join(f"rank {r}: {', '.join(h)}" for r, h in enumerate(every))
        raise PlanMismatchError(
            "the ranks emitted different stage code from the same plan (stage code hashes per stage: "
            f"{listing}). Every rank must build the same model (same class, config and leaf_modules) with the "
            "same fxpipe and torch versions.")


def agree_on_arguments(values: dict, group: dist.ProcessGroup) -> None:
    """Refuses, on every rank alike, arguments that must be equal on every rank and are not
    (``schedule``, ``chunks``): the stage code agrees whatever they are, but ranks running
    different schedules or micro-batch counts wait on transfers that never come (a hang until
    ``timeout``) or receive buffers of the wrong size (gloo aborts the process), measured.
    ``fxpipe.tune`` run on each rank may pick different ones from its timings."""
    every: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, dict(values), group=group)
    differ = [name for name in values if any(v[name] != every[0][name] for v in every)]  # type: ignore[index]
    if differ:
        listing = "; ".join(f"{name}: " + ", ".join(f"rank {r} {v[name]!r}" for r, v in enumerate(every))  # type: ignore[index]
                            for name in differ)
        raise DistributedError(
            f"the ranks called fxpipe.distributed.pipeline with different {' and '.join(differ)} ({listing}); every "
            "rank must pass the same ones (decide them once, e.g. on rank 0, and broadcast them: fxpipe.tune on "
            "each rank can choose differently from its own timings)")
