"""fxpipe.distributed against eager: gloo ranks on 127.0.0.1, spawned by torch.multiprocessing.

Each spawn runs several cases in one process group (starting processes is the slow part).
Every rank saves its losses, its parameters' gradients after two accumulated steps, and the
errors it saw; the parent compares them with the same model trained eagerly on the whole batch.
The parent waits a bounded time and kills the ranks if they overrun, so a hang fails the test.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import zoo

SPAWN_SECONDS = 240  # generous: two cores shared with other jobs


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                                 nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ShapeCross(nn.Module):
    """ints, a float and a torch.Size made in stage 0 and used in stage 2: non-tensor values
    carried across two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, shape, half = x.size(0), x.shape, x.size(1) / 4
        h = self.b(torch.tanh(self.a(x.view(shape))))
        return self.c(torch.tanh(h)).reshape(n, -1).view(shape) * half


class Scaled(nn.Module):
    """Its generated code holds the constant ``factor``: ranks given different factors emit
    different code from the same plan."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.factor)


class DropMLP(nn.Module):
    """Dropout in every stage: checkpointed micro-batches must recompute the same masks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5),
                                 nn.GELU(), nn.Linear(32, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any, dict]:
    """(model, x, y, loss_fn, pipeline options): the same on every rank and in the parent."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name.startswith("drop"):
        return DropMLP(), torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), F.mse_loss, {}
    if name.startswith("mlp"):
        return MLP(), torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), F.mse_loss, {}
    if name.startswith("unet"):
        model, (x,), _ = zoo.unet()
        return model, x, torch.randn(4, 2, 16, 16, generator=g), F.mse_loss, {}
    if name.startswith("gpt"):
        model, (x,), _ = zoo.gpt_tied()
        return model, x, torch.randint(0, 64, (4, 16), generator=g), _gpt_loss, {}
    if name.startswith("shape"):
        return (ShapeCross(), torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), F.mse_loss,
                {"split_points": ["b", "c"]})
    raise KeyError(name)


#: name -> (schedule, stages_per_rank, chunks); a name ending in a checkpoint mode builds
#: with it, others with the default ('except_last'); "drop" cases (dropout) are compared
#: with each other, not with eager
CASES = {
    "mlp-gpipe": ("gpipe", 1, 2),
    "mlp-1f1b": ("1f1b", 1, 4),
    "unet-gpipe": ("gpipe", 1, 2),
    "gpt-1f1b": ("1f1b", 1, 4),
    "shape-gpipe": ("gpipe", 1, 2),
    "mlp-1f1b-always": ("1f1b", 1, 4),
    "mlp-gpipe-never": ("gpipe", 1, 2),
    "unet-gpipe-always": ("gpipe", 1, 2),
    "unet-gpipe-never": ("gpipe", 1, 2),
    "drop-1f1b-except_last": ("1f1b", 1, 4),
    "drop-1f1b-always": ("1f1b", 1, 4),
    "drop-1f1b-never": ("1f1b", 1, 4),
}
EXACT_CASES = [n for n in CASES if not n.startswith("drop")]
DROP_CASES = [n for n in CASES if n.startswith("drop")]
SLOW_CASES = {  # run on 2 ranks: 4 stages
    "unet-gpipe-x2": ("gpipe", 2, 2),
    "gpt-interleaved-x2": ("interleaved1f1b", 2, 4),
    "unet-1f1b": ("1f1b", 1, 2),
    "unet-1f1b-always": ("1f1b", 1, 2),
    "mlp-gpipe-x2-always": ("gpipe", 2, 2),
    "drop-gpipe-x2-always": ("gpipe", 2, 2),
    "drop-gpipe-x2-never": ("gpipe", 2, 2),
}
CHECKPOINT_MODES = ("except_last", "always", "never")


def _mode(name: str) -> str:
    return next((m for m in CHECKPOINT_MODES if name.endswith("-" + m)), "except_last")


def _worker(rank: int, world: int, port: int, cases: dict, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.errors import BatchShapeError, DistributedError, PlanMismatchError

    import fxpipe.distributed.values as values

    recomputed = [0]  # micro-batch forwards run under torch.utils.checkpoint on this rank
    original = values.checkpoint

    def counting(*a: Any, **k: Any) -> Any:
        recomputed[0] += 1
        return original(*a, **k)

    values.checkpoint = counting
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for name, (schedule, per_rank, chunks) in cases.items():
        model, x, y, loss_fn, options = _case(name)
        pipe = fpd.pipeline(model, x, chunks=chunks, loss_fn=loss_fn, schedule=schedule,
                            stages_per_rank=per_rank, checkpoint=_mode(name), timeout=60, **options)
        torch.manual_seed(100 + rank)  # dropout masks: the same in every checkpoint mode
        recomputed[0] = 0
        losses = [pipe.step(x, target=y).item() for _ in range(2)]  # no zero_grad: accumulation
        checkpointed = recomputed[0]
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        out_eval = pipe.eval_step(x)
        checkpointed_in_eval = recomputed[0] - checkpointed
        try:
            pipe.step(x[:-1], target=y[:-1])
            refused = ""
        except BatchShapeError as e:
            refused = str(e)
        results[name] = {"losses": losses, "grads": grads, "eval": out_eval, "refused": refused,
                         "local": pipe.local, "checkpointed": checkpointed,
                         "checkpointed_in_eval": checkpointed_in_eval, "names": [n for n, _ in pipe.named_parameters()]}
        pipe.close()
    bn, (xb,), _ = zoo.bn_model()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    fpd.pipeline(bn, xb, chunks=2, loss_fn=F.mse_loss, timeout=60).close()
    results["build_keeps_state"] = all(torch.equal(before[k], v) for k, v in bn.state_dict().items())
    states = {}
    for mode in ("always", "never"):  # a recomputed forward must not update BatchNorm's buffers again
        bn, (xb,), _ = zoo.bn_model()
        with torch.no_grad():
            yb = torch.zeros_like(bn(xb))
        bn.load_state_dict(before)
        pipe = fpd.pipeline(bn, xb, chunks=2, loss_fn=F.mse_loss, checkpoint=mode, timeout=60)
        for _ in range(2):
            pipe.step(xb, target=yb)
        states[mode] = bn.state_dict()
        pipe.close()
    results["bn_buffers_same"] = all(torch.equal(states["always"][k], v) for k, v in states["never"].items())
    try:  # ranks building different models get a typed error on every rank, not a hang
        fpd.pipeline(Scaled(2.0 if rank == 0 else 3.0), torch.randn(4, 4), chunks=2, loss_fn=F.mse_loss,
                     timeout=60)
        results["mismatch"] = ""
    except (PlanMismatchError, DistributedError) as e:
        results["mismatch"] = type(e).__name__
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, cases: dict, tmp: Path) -> list[dict]:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent),
         os.environ.get("PYTHONPATH", "")])
    ctx = mp.start_processes(_worker, args=(world, _free_port(), cases, str(tmp)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + SPAWN_SECONDS
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed ranks did not finish within {SPAWN_SECONDS} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _eager(name: str) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    model, x, y, loss_fn, _ = _case(name)
    losses = []
    for _ in range(2):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(x)
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out


def _check(results: list[dict], cases: dict) -> None:
    world = len(results)
    for name, (_, per_rank, chunks) in cases.items():
        for res in results:  # 2 steps x micro-batches checkpointed x this rank's stages; none in eval_step
            want = {"always": chunks, "except_last": chunks - 1, "never": 0}[_mode(name)]
            assert res[name]["checkpointed"] == 2 * want * per_rank, (name, res[name]["checkpointed"])
            assert res[name]["checkpointed_in_eval"] == 0, name
        if name.startswith("drop"):
            continue  # dropout: see _check_same
        losses, grads, out = _eager(name)
        seen: set[str] = set()
        for rank, res in enumerate(results):
            r = res[name]
            assert r["local"] == [rank + i * world for i in range(per_rank)]
            torch.testing.assert_close(r["losses"], losses, msg=lambda m: f"{name} rank {rank} loss: {m}")
            assert set(r["grads"]) == set(r["names"]) & set(grads), name
            for n, g in r["grads"].items():
                torch.testing.assert_close(g, grads[n], msg=lambda m: f"{name} rank {rank} {n}: {m}")
            seen |= set(r["grads"])
            assert "shape" in r["refused"] and "micro-batches" in r["refused"], r["refused"]
        assert seen == set(grads), f"{name}: no rank holds {sorted(set(grads) - seen)}"
        last = (per_rank * world - 1) % world
        torch.testing.assert_close(results[last][name]["eval"], out)
        assert all(res[name]["eval"] is None for r, res in enumerate(results) if r != last)


def _check_same(results: list[dict], names: list[str]) -> None:
    """Cases that differ only in checkpoint mode give the same losses and gradients, bit for bit
    (dropout masks recomputed as drawn)."""
    base = names[0]
    for name in names[1:]:
        for rank, res in enumerate(results):
            assert res[name]["losses"] == res[base]["losses"], (name, rank)
            assert res[name]["grads"].keys() == res[base]["grads"].keys()
            for n, g in res[name]["grads"].items():
                assert torch.equal(g, res[base]["grads"][n]), f"{name} rank {rank} {n} differs from {base}"


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(3, CASES, tmp_path_factory.mktemp("dist3"))


@pytest.mark.parametrize("name", EXACT_CASES)
def test_exact_against_eager_on_three_ranks(three_ranks: list[dict], name: str) -> None:
    """Losses of two accumulated steps, every rank's gradients, eval outputs; a batch of
    another shape refused on every rank with BatchShapeError."""
    _check(three_ranks, {name: CASES[name]})


def test_dropout_is_the_same_in_every_checkpoint_mode(three_ranks: list[dict]) -> None:
    _check_same(three_ranks, DROP_CASES)
    # and dropout did act: without it, two steps with no optimizer step give the same loss
    assert three_ranks[0][DROP_CASES[0]]["losses"][0] != three_ranks[0][DROP_CASES[0]]["losses"][1]


def test_tied_embedding_gradient_is_summed_over_its_ranks(three_ranks: list[dict]) -> None:
    holders = [r for r, res in enumerate(three_ranks) if "tok.weight" in res["gpt-1f1b"]["names"]]
    assert holders == [0, 2]  # the embedding on the first stage, the LM head on the last


def test_building_leaves_buffers_as_they_were(three_ranks: list[dict]) -> None:
    """The fake run finding the stage metadata must not bump BatchNorm's num_batches_tracked."""
    assert [res["build_keeps_state"] for res in three_ranks] == [True] * 3


def test_recomputation_does_not_update_buffers_twice(three_ranks: list[dict]) -> None:
    """BatchNorm's running stats and num_batches_tracked after two steps: the same with
    checkpoint='always' as with 'never'."""
    assert [res["bn_buffers_same"] for res in three_ranks] == [True] * 3


def test_ranks_with_different_code_all_raise(three_ranks: list[dict]) -> None:
    assert [res["mismatch"] for res in three_ranks] == ["PlanMismatchError"] * 3


@pytest.mark.slow
def test_several_stages_per_rank_and_1f1b_portals(tmp_path: Path) -> None:
    results = _spawn(2, SLOW_CASES, tmp_path)
    _check(results, SLOW_CASES)
    _check_same(results, [n for n in SLOW_CASES if n.startswith("drop")])


def _failing_worker(rank: int, world: int, port: int, out: str) -> None:
    """The last rank's loss_fn raises in the first step; its peers wait on it mid-schedule."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, _, _ = _case("mlp")

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in loss_fn")

    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)
    try:
        pipe.step(x, target=y)
    except BaseException as e:
        Path(out, f"rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")
        raise


def test_a_rank_that_raises_ends_every_rank(tmp_path: Path) -> None:
    """No rank is left waiting: each exits with an error, within the bounded wait."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent),
         os.environ.get("PYTHONPATH", "")])
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_failing_worker, args=(r, 3, port, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_SECONDS
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} still waiting after {SPAWN_SECONDS} s"
    assert all(p.exitcode != 0 for p in procs)
    assert "boom in loss_fn" in (tmp_path / "rank2.txt").read_text()
    assert all((tmp_path / f"rank{r}.txt").exists() for r in (0, 1))  # they raised too, not killed
