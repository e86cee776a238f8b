"""Ranks spawned for a benchmark, killed at a deadline: a hang ends the run, not the machine's day."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, deadline_s: float) -> None:
    """``fn(rank, *args)`` on ``nprocs`` spawned processes; raises SystemExit, the ranks
    killed, if they have not all finished after ``deadline_s`` seconds."""
    ctx: Any = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise SystemExit(f"the {nprocs} ranks did not finish within {deadline_s} s; killed")
