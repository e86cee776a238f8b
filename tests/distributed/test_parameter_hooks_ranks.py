"""A parameter's gradient hook on a rank: torch's schedules run one backward per micro-batch,
so the hook would see each micro-batch's part (see tests/test_parameter_hooks.py). Refused on
every rank, before anything is sent, whichever rank holds the hooked parameter."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
from dist_harness import run_ranks


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    import fxpipe.distributed as fpd
    from fxpipe.errors import FxpipeError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=nn.functional.mse_loss, timeout=60)
    if rank == world - 1:
        next(p for _, p in pipe.named_parameters()).register_hook(lambda g: g.clamp(-0.1, 0.1))
    said = ""
    try:
        pipe.step(x, target=y)
    except FxpipeError as e:  # StepError where the hook is, PeerFailedError naming it elsewhere
        said = str(e)
    pipe.close()
    torch.save(said, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_gradient_hook_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    said = run_ranks(_worker, 2, (), tmp_path)
    assert all("has a gradient hook" in s and "schedule='gpipe'" not in s for s in said), said
