"""fxpipe.distributed on a GPU over NCCL, on one GPU: world size 1 with several stages on the rank.

torch.distributed.pipelining hands activations between the stages of one rank by a function
call, so one rank running a V (``zbv``, 2 stages) or a looped schedule makes a whole NCCL/CUDA
step without any send between ranks: the process group fxpipe starts (NCCL on
``cuda:LOCAL_RANK``), stage metadata found on the GPU, the value codec, the loss broadcast,
checkpointing on CUDA, bf16 autocast, and a meta-device build materialised on the GPU. Only
NCCL's own send/recv between ranks is left to PyTorch's multi-GPU tests. Every case is
compared with eager on the same GPU over 3 SGD (momentum) steps, outputs and every gradient.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dist_harness import check, run_ranks, spawn
from dist_models import case
from exact import assert_close_scaled, largest

pytestmark = pytest.mark.cuda

#: name -> (schedule, stages per rank, chunks); see tests/distributed/test_distributed.py
ONE_GPU = {
    **{f"gpt-zbv-{m}": ("zbv", 2, 4) for m in ("except_last", "always", "never")},
    **{f"unet-zbv-{m}": ("zbv", 2, 4) for m in ("except_last", "always", "never")},
    "hf-zbv": ("zbv", 2, 4),
    "gpt-gpipe": ("gpipe", 2, 2),
    "unet-interleaved1f1b": ("interleaved1f1b", 2, 2),
    "hf-interleaved1f1b-always": ("interleaved1f1b", 2, 2),
    "mlp-zbv-bf16-always": ("zbv", 2, 4),
    "mlp-zbv-bf16-never": ("zbv", 2, 4),
    "gpt-zbv-bf16": ("zbv", 2, 4),
}


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    return spawn(1, ONE_GPU, tmp_path_factory.mktemp("nccl1"), {"torchrun": True, "device": "cuda"})


@pytest.mark.parametrize("name", list(ONE_GPU))
def test_one_gpu_is_exact_against_eager_on_the_gpu(one_gpu: list[dict], name: str) -> None:
    check(one_gpu, {name: ONE_GPU[name]}, device="cuda")


def test_the_group_fxpipe_starts_is_nccl_on_the_rank_gpu(one_gpu: list[dict]) -> None:
    r = one_gpu[0]
    assert r["backend"] == "nccl", r["backend"]
    assert r["device"] == "cuda:0" and r["grad_devices"] == ["cuda:0"]


def _meta_worker(rank: int, world: int, port: int, weights: str, out: str) -> None:
    """A meta-device build materialised on the GPU, and the full build, trained side by side."""
    import zoo
    from dist_models import _gpt_loss

    import fxpipe.distributed as fpd

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _, (x,), _ = zoo.gpt_tied(batch=4)
    y = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for how in ("meta", "full"):
        if how == "meta":
            with torch.device("meta"):
                model = zoo.TinyGPT()
        else:
            model = zoo.TinyGPT()
            model.load_state_dict(torch.load(weights))
        pipe = fpd.pipeline(model, x, chunks=4, loss_fn=_gpt_loss, schedule="zbv", stages_per_rank=2, timeout=60,
                            state_dict=weights if how == "meta" else None)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        steps = []
        for _ in range(3):
            loss = pipe.step(x, target=y).item()
            grads = {n: p.grad.to("cpu", copy=True) for n, p in pipe.named_parameters()}
            opt.step()
            opt.zero_grad()
            steps.append({"loss": loss, "grads": grads})
        results[how] = {"steps": steps, "devices": sorted({str(p.device) for p in model.parameters()})}
        pipe.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_a_meta_build_materialises_on_the_gpu_and_trains_as_the_full_build(tmp_path: Path) -> None:
    import zoo

    torch.manual_seed(0)
    weights = str(tmp_path / "gpt.pt")
    torch.save(zoo.TinyGPT().state_dict(), weights)
    (r,) = run_ranks(_meta_worker, 1, (weights,), tmp_path)
    assert r["meta"]["devices"] == ["cuda:0"] and r["full"]["devices"] == ["cuda:0"]
    for meta, full in zip(r["meta"]["steps"], r["full"]["steps"]):
        assert meta["loss"] == full["loss"]
        top = max(largest(g) for g in full["grads"].values())
        for n, g in full["grads"].items():
            assert_close_scaled(meta["grads"][n], g, None, what=f"grad {n}", floor_of=top)


def test_cuda_inputs_and_a_cuda_model_are_accepted(tmp_path: Path) -> None:
    """A model and a batch already on the GPU (the usual script) train as CPU-given ones."""
    (r,) = run_ranks(_cuda_given_worker, 1, (), tmp_path)
    assert r["same_loss"], r


def _cuda_given_worker(rank: int, world: int, port: int, out: str) -> None:
    import fxpipe.distributed as fpd

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    losses = []
    for where in ("cpu", "cuda"):
        model, x, y, loss_fn, _ = case("mlp", 4)
        model.to(where)
        x, y = x.to(where), y.to(where)
        with fpd.pipeline(model, x, chunks=4, loss_fn=loss_fn, schedule="zbv", stages_per_rank=2,
                          timeout=60) as pipe:
            losses.append(pipe.step(x, target=y).item())
    torch.save({"same_loss": losses[0] == losses[1], "losses": losses}, os.path.join(out, f"rank{rank}.pt"))

