"""What a distributed build warns of: ranks of one pipeline seeded alike draw the same dropout
masks stage by stage (:mod:`fxpipe.distributed._seeds`; ranks seeded apart, or a model drawing
nothing, build quietly); ``model.state_dict()`` on a rank holding only its stages has the other
ranks' tensors on meta (:mod:`fxpipe.distributed._eager_guard`; ``pipe.state_dict()`` is quiet)."""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from dist_harness import run_ranks


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result = {}
    for case, seed, p in (("alike", 0, 0.5), ("apart", rank, 0.5), ("no dropout", 0, 0.0)):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = fpd.pipeline(model, torch.randn(8, 8), chunks=2, loss_fn=lambda o, t: o.pow(2).mean(), timeout=60,
                                progress=False)
        result[case] = [str(w.message) for w in caught if "same random generator state" in str(w.message)]
        if case == "alike":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.state_dict()
                pipe.state_dict()
            result["state_dict"] = [str(w.message) for w in caught]
        pipe.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_seeded_alike_and_a_partial_state_dict_are_warned(tmp_path: Path) -> None:
    """And torch.save(model.state_dict()) on a rank kept the other ranks' tensors on meta,
    silently, until loading it failed with torch's 'Cannot copy out of meta tensor' (a trial)."""
    for got in run_ranks(_worker, 2, (), tmp_path):
        assert len(got["state_dict"]) == 1 and "tensors on the meta device" in got["state_dict"][0]
        assert "pipe.state_dict()" in got["state_dict"][0]
        assert len(got["alike"]) == 1 and "torch.manual_seed(base_seed + torch.distributed.get_rank())" in got["alike"][0]
        assert got["apart"] == [] and got["no dropout"] == []
