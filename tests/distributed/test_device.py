"""Where a rank runs (fxpipe.distributed._device): the process group fxpipe starts under
torchrun, the device that follows its backend, one GPU per rank, and the world-size-1 V
schedule, which runs a whole step in one process (torch passes activations between the two
stages of a rank by a function call), the way the `cuda` tests run NCCL on one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import check, spawn
from dist_models import case
from fxpipe.distributed._device import backend_for, ensure_process_group, shared_gpus
from fxpipe.errors import DistributedError

#: one rank, two stages on it: every schedule that runs several stages per rank
ONE_RANK = {
    "gpt-zbv": ("zbv", 2, 4),
    "unet-zbv-always": ("zbv", 2, 4),
    "gpt-interleaved1f1b-never": ("interleaved1f1b", 2, 2),
    "unet-gpipe": ("gpipe", 2, 2),
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(1, ONE_RANK, tmp_path_factory.mktemp("torchrun1"), {"torchrun": True})


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_one_rank_runs_every_stage_exactly(one_rank: list[dict], name: str) -> None:
    """World size 1: no send between ranks, outputs and every gradient as eager's over three
    optimizer steps, with multi-sample micro-batches."""
    check(one_rank, {name: ONE_RANK[name]})


def test_under_torchrun_the_group_is_started_for_the_hardware(one_rank: list[dict]) -> None:
    """No init_process_group in the script: fxpipe starts gloo on a machine without CUDA, and
    the stages and their parameters stay on the CPU."""
    r = one_rank[0]
    assert r["backend"] == "gloo"
    assert r["device"] == "cpu" and r["grad_devices"] == ["cpu"]


def test_two_torchrun_ranks_without_a_group_train_exactly(tmp_path: Path) -> None:
    """The group fxpipe starts from torchrun's environment joins several ranks: 2 ranks, a V of
    4 stages, the U-Net's skips crossing ranks."""
    cases = {"unet-zbv": ("zbv", 2, 4)}
    results = spawn(2, cases, tmp_path, {"torchrun": True})
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    check(results, cases)


def test_a_device_the_backend_cannot_send_from_is_refused(one_rank: list[dict]) -> None:
    r = one_rank[0]
    if torch.cuda.is_available():
        assert "would run its stages on 'cuda'" in r["refused_cuda"] and "uses 'gloo'" in r["refused_cuda"]
        assert "init_process_group('nccl')" in r["refused_cuda"]
    else:  # no group would help: it says so, not "call init_process_group('nccl')"
        assert r["refused_cuda"].startswith("device='cuda', but CUDA is not available"), r["refused_cuda"]
        assert "init_process_group" not in r["refused_cuda"]
    assert "'cuda' (NCCL) or 'cpu' (gloo), not on 'mps'" in r["refused_mps"]


def test_no_group_outside_torchrun_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpipe.distributed as fpd

    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    model, x, y, loss_fn, _ = case("mlp", 2)
    with pytest.raises(DistributedError, match=r"not part of one.*RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
                                               r"not set.*torchrun --nproc-per-node=N"):
        fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DistributedError, match=r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        ensure_process_group(__import__("datetime").timedelta(seconds=5))
    assert not dist.is_initialized()


def test_the_backend_of_each_device_type() -> None:
    assert backend_for("nccl", "cuda") == "nccl"
    assert backend_for("gloo", "cpu") == "gloo"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("cuda:nccl", "cpu") is None


def test_ranks_sharing_a_gpu_are_found() -> None:
    """The identities ranks write to the store (host and GPU UUID): equal ones share a GPU."""
    assert shared_gpus(["a|GPU-1", "a|GPU-2", "b|GPU-1"]) == []
    assert shared_gpus(["a|GPU-1", "a|GPU-2", "a|GPU-1", "a|GPU-2", "a|GPU-3"]) == [[0, 2], [1, 3]]


def test_the_timeout_is_checked_before_any_group_is_started() -> None:
    import fxpipe.distributed as fpd

    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        fpd.pipeline(torch.nn.Linear(2, 2), torch.randn(2, 2), chunks=1, loss_fn=F.mse_loss, timeout=0)
    assert not dist.is_initialized()
