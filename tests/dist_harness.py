"""Spawned gloo ranks running fxpipe.distributed cases, and their comparison with eager.

Each spawn runs several cases in one process group (starting processes is the slow part).
Every case trains for 3 SGD steps (momentum: the optimizer has state): the first step's
gradient is accumulated over two ``step()`` calls on two batches, the others take one batch
each. Every rank saves its losses, its parameters' gradients before each optimizer step, its
parameters after each, an ``eval_step`` output and the errors it saw; the parent compares them
with the same model trained eagerly on the whole batches (:func:`check`). The parent waits a
bounded time and kills the ranks if they overrun, so a hang fails the test.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils._pytree as pytree

import zoo
from dist_models import CountedMLP, Mixer, Scaled, case
from exact import BF16, Tol, assert_close_scaled, assert_same, largest
from fxpipe.distributed._launch import free_port
from fxpipe.distributed._schedules import rank_of_stage, stages_of_rank

SPAWN_SECONDS = 240  # generous: two cores shared with other jobs
SLOW_SPAWN_SECONDS = 540
LR, MOMENTUM = 0.05, 0.9
#: the batches of each optimizer step: 0 is (x, y), 1 the same samples in reverse order
TRAJECTORY = ([0, 1], [0], [1])

CHECKPOINT_MODES = ("except_last", "always", "never")


def mode(name: str) -> str:
    return next((m for m in CHECKPOINT_MODES if name.endswith("-" + m)), "except_last")


def autocast(name: str, device: str = "cpu") -> Any:
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16) if "-bf16" in name else contextlib.nullcontext()


def to_cpu(tree: Any) -> Any:
    """Results saved by a rank, on the CPU (a GPU rank's gradients are compared in the parent)."""
    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def batches_of(x: Any, y: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """Batch 0 and batch 1 (the same samples in reverse order: other micro-batches)."""
    flip = pytree.tree_map(lambda t: t.flip(0) if isinstance(t, torch.Tensor) else t, x)
    return [(x, y), (flip, y.flip(0))]


def runcase(fpd: Any, name: str, spec: tuple, rank: int, recomputed: list[int], device: str = "cpu") -> dict:
    schedule, per_rank, chunks = spec
    model, x, y, loss_fn, options = case(name, chunks)
    batches = batches_of(x, y)  # given on the CPU: the pipeline moves them to its device
    with autocast(name, device):
        pipe = fpd.pipeline(model, x, chunks=chunks, loss_fn=loss_fn, schedule=schedule, stages_per_rank=per_rank,
                            checkpoint=mode(name), timeout=60, **options)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
        torch.manual_seed(100 + rank)  # dropout masks: the same in every checkpoint mode
        recomputed[0] = 0
        counted = {f"stage {k} {n}": m for k in pipe.local for n, m in pipe.stages[k].named_modules()
                   if hasattr(m, "runs")}  # dist_models.Counted: forward runs of this rank's layers
        for m in counted.values():
            m.runs = 0  # the build ran them too
        losses, grads, params = [], [], []
        for step in TRAJECTORY:
            for b in step:  # no zero_grad in between: accumulation
                xb, yb = batches[b]
                losses.append(pipe.step(xb, target=yb).item())
            grads.append({n: p.grad.to("cpu", copy=True) for n, p in pipe.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            params.append({n: p.detach().to("cpu", copy=True) for n, p in pipe.named_parameters()})
        checkpointed = recomputed[0]
        runs = {n: m.runs for n, m in counted.items()}
        out_eval = pipe.eval_step(x)
    checkpointed_in_eval = recomputed[0] - checkpointed
    cut = pytree.tree_map(lambda t: t[:-1] if isinstance(t, torch.Tensor) else t, x)
    try:
        with autocast(name, device):
            pipe.step(cut, target=y[:-1])
        refused = ""
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    result = {"losses": losses, "grads": grads, "params": params, "eval": to_cpu(out_eval), "refused": refused,
              "local": pipe.local, "placement": pipe.placement, "checkpointed": checkpointed, "runs": runs,
              "checkpointed_in_eval": checkpointed_in_eval, "names": [n for n, _ in pipe.named_parameters()]}
    pipe.close()
    return result


def bn_buffers_same(fpd: Any, spec: tuple) -> bool:
    """BatchNorm's running stats and num_batches_tracked after two steps: the same with
    checkpoint='always' (recomputed forwards) as with 'never'."""
    schedule, per_rank, chunks = spec
    states = {}
    for mode in ("always", "never"):
        torch.manual_seed(0)
        bn, (xb,), _ = zoo.bn_model(batch=chunks * -(-8 // chunks))
        yb = torch.zeros(xb.shape[0], 4)
        pipe = fpd.pipeline(bn, xb, chunks=chunks, loss_fn=F.mse_loss, schedule=schedule, stages_per_rank=per_rank,
                            checkpoint=mode, timeout=60)
        for _ in range(2):
            pipe.step(xb, target=yb)
        states[mode] = {k: v.clone() for k, v in pipe.state_dict().items()}  # this rank's (the rest released)
        pipe.close()
    return all(torch.equal(states["always"][k], v) for k, v in states["never"].items())


def misc(fpd: Any, rank: int) -> dict:
    """What the default spawn checks besides the cases: refusals and state kept."""
    from fxpipe.errors import DistributedError, MicroBatchError, PlanMismatchError

    results: dict[str, Any] = {}
    bn, (xb,), _ = zoo.bn_model()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    fpd.pipeline(bn, xb, chunks=2, loss_fn=F.mse_loss, timeout=60).close()
    # what this rank holds as it was; the other ranks' stages released to meta (fxpipe.distributed._weights)
    results["build_keeps_state"] = all(v.is_meta or torch.equal(before[k], v) for k, v in bn.state_dict().items())
    results["released"] = any(v.is_meta for v in bn.state_dict().values())
    try:  # ranks building different models get a typed error on every rank, not a hang
        fpd.pipeline(Scaled(2.0 if rank == 0 else 3.0), torch.randn(4, 4), chunks=2, loss_fn=F.mse_loss,
                     timeout=60)
        results["mismatch"] = ""
    except (PlanMismatchError, DistributedError) as e:
        results["mismatch"] = type(e).__name__
    try:  # what the single-process pipeline refuses in training mode is refused on every rank
        fpd.pipeline(Mixer(), torch.randn(4, 8), chunks=2, loss_fn=F.mse_loss, leaf_modules=["n"], timeout=60)
        results["train_refused"] = ""
    except MicroBatchError as e:
        results["train_refused"] = f"{type(e).__name__}: {e}"
    model, x, y, loss_fn, _ = case("mlp", 2)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)
    try:  # built without autocast, stepped under it: refused before anything is sent
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(x, target=y)
        results["autocast_refused"] = ""
    except DistributedError as e:
        results["autocast_refused"] = f"{type(e).__name__}: {e}"
    results["after_refusal"] = pipe.step(x, target=y).item()  # the pipeline still runs
    pipe.close()
    return results


def devices(fpd: Any) -> dict:
    """What a torchrun rank without a GPU sees of the device choice: the group fxpipe started,
    the device of its stages, and the refusal of a GPU over gloo."""
    import torch.distributed as dist

    from fxpipe.distributed._device import rank_device
    from fxpipe.errors import DistributedError

    results: dict[str, Any] = {"backend": dist.get_backend()}
    model, x, y, loss_fn, _ = case("mlp", 2)
    with fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60) as pipe:
        results["device"] = str(pipe.device)
        results["grad_devices"] = sorted({str(p.device) for p in pipe.parameters()})
    for wanted in ("cuda", "mps"):
        try:
            rank_device(wanted)
            results[f"refused_{wanted}"] = ""
        except DistributedError as e:
            results[f"refused_{wanted}"] = str(e)
    return results


def counting(original: Any, counter: list[int]) -> Any:
    """``original`` (``StageCheckpoint.__call__``: one checkpointed micro-batch forward) counted."""

    def call(self: Any, *a: Any) -> Any:
        counter[0] += 1
        return original(self, *a)

    return call


def worker(rank: int, world: int, port: int, cases: dict, extras: dict, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    import fxpipe.distributed._recompute as recompute

    recomputed = [0]  # micro-batch forwards run under checkpointing on this rank
    recompute.StageCheckpoint.__call__ = counting(recompute.StageCheckpoint.__call__, recomputed)
    torch.set_num_threads(1)
    if extras.get("torchrun"):  # torchrun's environment, no group: fxpipe.distributed starts it
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        if extras.get("device", "cpu") == "cpu":  # on a GPU machine too: no GPU seen, so gloo on the CPU
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for name, spec in cases.items():
        results[name] = runcase(fpd, name, spec, rank, recomputed, extras.get("device", "cpu"))
    if "bn" in extras:
        results["bn_buffers_same"] = bn_buffers_same(fpd, extras["bn"])
    if extras.get("misc"):
        results.update(misc(fpd, rank))
    if extras.get("torchrun"):
        results.update(devices(fpd))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def in_process(cases: dict, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The cases on world size 1, in this process: every stage on rank 0 (stages on one rank
    pass values by a call, nothing is sent). As :func:`spawn` returns them."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    import fxpipe.distributed._recompute as recompute

    recomputed = [0]
    monkeypatch.setattr(recompute.StageCheckpoint, "__call__", counting(recompute.StageCheckpoint.__call__, recomputed))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        return [{name: runcase(fpd, name, spec, 0, recomputed) for name, spec in cases.items()}]
    finally:
        dist.destroy_process_group()


def environment() -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent),
         os.environ.get("PYTHONPATH", "")])


def spawn(world: int, cases: dict, tmp: Path, extras: dict | None = None,
           seconds: float = SPAWN_SECONDS) -> list[dict]:
    return run_ranks(worker, world, (cases, extras or {}), tmp, seconds)


def run_ranks(fn: Any, world: int, args: tuple, tmp: Path, seconds: float = SPAWN_SECONDS) -> list[dict]:
    """``fn(rank, world, port, *args, str(tmp))`` on ``world`` spawned ranks; each saves its
    results to ``tmp/rank{r}.pt``. The ranks are killed, and the test fails, after ``seconds``."""
    environment()
    ctx = mp.start_processes(fn, args=(world, free_port(), *args, str(tmp)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed ranks did not finish within {seconds} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def eager_run(name: str, chunks: int, device: str = "cpu") -> dict:
    """The same trajectory on the whole batches, one process, on ``device``; results on the CPU."""
    model, x, y, loss_fn, _ = case(name, chunks)
    model.to(device)
    x, y = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (x, y))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batches = batches_of(x, y)
    losses, grads, params = [], [], []
    with autocast(name, device):
        for step in TRAJECTORY:
            for b in step:
                xb, yb = batches[b]
                loss = loss_fn(model(xb), yb)
                loss.backward()
                losses.append(loss.item())
            grads.append({n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            params.append({n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()})
        with torch.no_grad():
            out = model(x)
    return {"losses": losses, "grads": grads, "params": params, "eval": to_cpu(out)}


#: placements written out, so a wrong rank_of_stage fails here too
PLACED = {("zbv", 3): [0, 1, 2, 2, 1, 0], ("zbv", 2): [0, 1, 1, 0], ("interleavedzb", 3): [0, 1, 2, 0, 1, 2],
          ("interleaved1f1b", 2): [0, 1, 0, 1], ("gpipe", 3): [0, 1, 2], ("1f1b", 3): [0, 1, 2]}


def tolerance(name: str) -> Tol | None:
    """bf16 autocast: micro-batches round differently from the whole batch. Otherwise the
    float32 default of tests/exact.py (sums over micro-batches in another order)."""
    return BF16 if "-bf16" in name else None


def check(results: list[dict], cases: dict, device: str = "cpu") -> None:
    world = len(results)
    for name, (schedule, per_rank, chunks) in cases.items():
        placement = rank_of_stage(schedule, world, per_rank)
        if (schedule, world) in PLACED:
            assert placement == PLACED[schedule, world], (schedule, world, placement)
        steps = sum(len(s) for s in TRAJECTORY)
        for rank, res in enumerate(results):  # steps x micro-batches checkpointed x this rank's stages
            r = res[name]
            assert r["placement"] == placement, name
            assert r["local"] == stages_of_rank(schedule, world, per_rank, rank), (name, rank, r["local"])
            want = {"always": chunks, "except_last": chunks - 1, "never": 0}[mode(name)]
            assert r["checkpointed"] == steps * want * per_rank, (name, r["checkpointed"])
            # every layer runs once per micro-batch, and once more per checkpointed one (recomputed
            # once for all its backward passes, also under zero bubble)
            assert r["runs"] == {n: steps * (chunks + want) for n in r["runs"]}, (name, rank, r["runs"])
            assert r["checkpointed_in_eval"] == 0, name
            assert "shape" in r["refused"] and "micro-batches" in r["refused"], (name, r["refused"])
        if name.startswith("counted"):  # each of its layers ran on one rank
            assert sum(len(res[name]["runs"]) for res in results) == len(CountedMLP().layers), name
        if name.startswith("drop"):
            continue  # dropout: see check_same
        eager = eager_run(name, chunks, device)
        close = tolerance(name)
        seen: set[str] = set()
        for rank, res in enumerate(results):
            r = res[name]
            assert_close_scaled(torch.tensor(r["losses"]), torch.tensor(eager["losses"]), close,
                                what=f"{name} rank {rank} losses")
            # a rank holds some parameters: their magnitude floor is the whole model's
            for i, (got, want_grads) in enumerate(zip(r["grads"], eager["grads"])):
                assert set(got) == set(r["names"]) & set(want_grads), (name, rank, i)
                top = max(largest(g) for g in want_grads.values())
                for n, g in got.items():
                    assert_close_scaled(g, want_grads[n], close, what=f"{name} rank {rank} step {i} grad {n}",
                                        floor_of=top)
            for i, (got, want_params) in enumerate(zip(r["params"], eager["params"])):
                assert set(got) == set(r["names"]), (name, rank, i)
                top = max(largest(p) for p in want_params.values())
                for n, p in got.items():
                    assert_close_scaled(p, want_params[n], close, what=f"{name} rank {rank} after step {i} {n}",
                                        floor_of=top)
            seen |= set(r["grads"][0])
        assert seen == set(eager["grads"][0]), f"{name}: no rank holds {sorted(set(eager['grads'][0]) - seen)}"
        last = placement[-1]
        assert_same(results[last][name]["eval"], eager["eval"], close)
        assert all(res[name]["eval"] is None for r, res in enumerate(results) if r != last)


def check_same(results: list[dict], names: list[str]) -> None:
    """Cases that differ only in checkpoint mode give the same losses, gradients and
    parameters, bit for bit (dropout masks recomputed as drawn, autocast restored)."""
    base = names[0]
    for name in names[1:]:
        for rank, res in enumerate(results):
            assert res[name]["losses"] == res[base]["losses"], (name, rank)
            for key in ("grads", "params"):
                for i, (got, want) in enumerate(zip(res[name][key], res[base][key])):
                    assert got.keys() == want.keys()
                    for n, g in got.items():
                        assert torch.equal(g, want[n]), f"{name} rank {rank} {key} {i} {n} differs from {base}"


def check_dropout_acted(results: list[dict], name: str, chunks: int) -> None:
    """Without dropout (eval mode), the first loss would be eager's eval-mode loss."""
    model, x, y, loss_fn, _ = case(name, chunks)
    with torch.no_grad():
        plain = loss_fn(model.eval()(x), y).item()
    assert results[0][name]["losses"][0] != pytest.approx(plain, rel=1e-4)

