"""Pipeline x data parallel on a DeviceMesh (issue #32): 4 gloo ranks as 2 replicas of a
2-rank pipeline, each replica on its own shard of the global batch. Each rank saves what it saw
to ``rank{r}.pt``; the parent compares it with eager training on the global batch."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import SLOW_SPAWN_SECONDS, run_ranks
from dist_models import case
from exact import assert_close_scaled

STEPS = 3
LR = 1e-2
ADAM = {"lr": LR, "eps": 1e-6}  # eps: see test_training_run.ADAM
CLIP = 0.05


def _join(rank: int, world: int, port: int, dp: int = 2) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "pp"))


def _leave() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of the tied GPT and their targets; the second replica's half ignores more
    targets (-100) than the first's, so each replica counts another number of labels."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 64, (8, 16), generator=g)
    y = torch.randint(0, 64, (8, 16), generator=g)
    y[4:, 10:] = -100
    y[5, :3] = -100
    y[1, 15] = -100
    return x, y


def _steps(step: Any, clip: Any, opt: torch.optim.Optimizer, named: Any, x: torch.Tensor, y: torch.Tensor) -> dict:
    """STEPS AdamW steps: the first accumulated over the batch and its reverse, the last clipped
    by the global norm. ``step(x, y)`` returns the loss; ``clip(max)`` the norm."""
    losses, grads, params, norms = [], [], [], []
    for i in range(STEPS):
        for xb, yb in ([(x, y), (x.flip(0), y.flip(0))] if i == 0 else [(x, y)]):
            losses.append(float(step(xb, yb)))
        if i == STEPS - 1:
            norms.append(float(clip(CLIP)))
        grads.append({n: whole(p.grad) for n, p in named() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        params.append({n: whole(p.detach()) for n, p in named()})
    return {"losses": losses, "grads": grads, "params": params, "norms": norms}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, gathered whole when it is a DTensor (``'fsdp'``: every replica of the
    stage calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _eager() -> dict:
    model, _, _, loss_fn, _ = case("gpt", 2)
    x, y = global_batch()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(xb), yb)
        loss.backward()
        return loss.detach()

    run = _steps(step, lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m), opt,
                 model.named_parameters, x, y)
    with torch.no_grad():
        run["eval"] = {dp: list(model(x).chunk(dp)) for dp in (2, 4)}  # each replica's shard, after training
    return run


def _ddp_worker(rank: int, world: int, port: int, schedules: list, dp: int, out: str,
                data_parallel: str = "ddp") -> None:
    import fxpipe.distributed as fpd
    from fxpipe.errors import BatchMismatchError, DistributedError, PeerFailedError

    mesh = _join(rank, world, port, dp)
    x, y = global_batch()
    result: dict = {}
    for schedule, per_rank in schedules:
        model, _, _, loss_fn, _ = case("gpt", 2)  # its embedding tied to its head: on the first and last rank
        pipe = fpd.pipeline(model, pipe_sample(x, dp), chunks=2, loss_fn=loss_fn, schedule=schedule,
                            stages_per_rank=per_rank, mesh=mesh, data_parallel=data_parallel, timeout=60)
        opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
        run = _steps(lambda xb, yb: pipe.step(pipe.shard(xb), target=pipe.shard(yb)), pipe.clip_grad_norm_, opt,
                     pipe.named_parameters, x, y)
        run.update(dp=(pipe.dp_rank, pipe.dp_size), local=pipe.local)
        # what this rank holds of its parameters (a shard of each under 'fsdp') and of the whole stages
        run["held"] = (sum(sharded(p).numel() for p in pipe.parameters()), sum(p.numel() for p in pipe.parameters()))
        run["eval"] = pipe.eval_step(pipe.shard(x))  # per replica: its own shard's outputs, on its last rank
        if schedule == schedules[0][0]:
            try:  # the same batch on both replicas: refused on every rank
                pipe.step(x[:8 // dp], target=y[:8 // dp])
                run["same"] = "ran"
            except BatchMismatchError as e:
                run["same"] = f"{type(e).__name__}: {e}"
            try:  # a bad target on replica 1's last rank only: named on every rank of both replicas
                bad = y[:3] if rank == 3 else pipe.shard(y)
                pipe.step(pipe.shard(x), target=bad)
                run["failed"] = "ran"
            except (PeerFailedError, Exception) as e:
                run["failed"] = f"{type(e).__name__}: {e}"
            if data_parallel == "ddp":  # a weight changed on replica 1's first rank only: refused on every rank
                from fxpipe.errors import ReplicaWeightsError

                name, p = list(pipe.named_parameters())[1]  # not the tied embedding, whose copies are checked first
                with torch.no_grad():
                    kept = p.clone()
                    if rank == pp_rank(rank, world, dp, 0, 1):
                        p.add_(1e-3)
                try:
                    pipe.step(pipe.shard(x), target=pipe.shard(y))
                    run["drift"] = "ran"
                except ReplicaWeightsError as e:
                    run["drift"] = (f"{type(e).__name__}: {e}", e.parameter == name, e.ranks)
                with torch.no_grad():
                    p.copy_(kept)
                run["drift_fixed"] = float(pipe.step(pipe.shard(x), target=pipe.shard(y)))
                opt.zero_grad()
        result[schedule] = run
        try:  # the model eagerly on this rank, which holds only its stages (its shards under 'fsdp')
            model(x[:2])
            run["eager"] = "ran"
        except DistributedError as e:
            run["eager"] = f"{type(e).__name__}: {e}"
        pipe.close()
        if data_parallel == "fsdp":  # the model holds this rank's shards now: a new build is refused, named
            try:
                fpd.pipeline(model, pipe_sample(x, dp), chunks=2, loss_fn=loss_fn, mesh=mesh, data_parallel="fsdp",
                             timeout=60)
                run["again"] = "built"
            except DistributedError as e:
                run["again"] = f"{type(e).__name__}: {e}"
    if schedules[0][0] == "gpipe":  # BatchNorm's running statistics would drift apart on the replicas
        import zoo
        from fxpipe.errors import MutationError

        bn, (xb,), _ = zoo.bn_model()
        try:
            fpd.pipeline(bn, xb, chunks=2, loss_fn=torch.nn.functional.mse_loss, mesh=mesh, data_parallel="ddp",
                         timeout=60)
            result["bn"] = "built"
        except MutationError as e:
            result["bn"] = f"{type(e).__name__}: {e}"
    torch.save(result, Path(out) / f"rank{rank}.pt")
    _leave()


def pp_rank(rank: int, world: int, dp: int, position: int, replica: int) -> int:
    """The global rank at pipeline ``position`` of ``replica`` (the mesh's rows are replicas)."""
    return replica * (world // dp) + position


def sharded(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def pipe_sample(x: torch.Tensor, dp: int = 2) -> torch.Tensor:
    """The build's sample: one replica's share of the global batch (its shape)."""
    return x[: x.shape[0] // dp]


def _check(ranks: list[dict], schedule: str, dp: int = 2, data_parallel: str = "ddp") -> None:
    want = _eager()
    for r, got in enumerate(ranks):
        run = got[schedule]
        pp = len(ranks) // dp
        assert run["dp"] == (r // pp, dp)
        for a, b in zip(run["losses"], want["losses"], strict=True):  # the global batch's loss on every rank
            assert_close_scaled(torch.tensor(a), torch.tensor(b), what="loss")
        assert_close_scaled(torch.tensor(run["norms"]), torch.tensor(want["norms"]), what="global norm")
        for i, grads in enumerate(run["grads"]):
            assert grads, "no gradient on this rank"
            for name, g in grads.items():  # the global batch's gradient, tied weight included
                assert_close_scaled(g, want["grads"][i][name], what=f"step {i} grad {name} on rank {r}")
        for i, params in enumerate(run["params"]):
            for name, p in params.items():  # Adam near-zero gradients: see test_training_run
                assert_close_scaled(p, want["params"][i][name], {"atol": 1e-2 * LR}, what=f"step {i} {name}")
        last = 0 if schedule == "zbv" else pp - 1  # the pipeline position of the last stage's rank (zbv: a V)
        if r % pp == last:
            assert_close_scaled(run["eval"], want["eval"][dp][r // pp], what="eval_step on the replica's shard")
        else:
            assert run["eval"] is None
    # the replicas hold equal weights, tied copies included
    for r in range(pp, len(ranks)):
        for name, p in ranks[r][schedule]["params"][-1].items():
            assert torch.equal(p, ranks[r % pp][schedule]["params"][-1][name]), name


def test_two_replicas_of_a_two_rank_pipeline_train_as_eager_on_the_global_batch(tmp_path: Path) -> None:
    ranks = run_ranks(_ddp_worker, 4, ([("gpipe", 1)], 2), tmp_path)
    _check(ranks, "gpipe")
    for r, got in enumerate(ranks):
        same = got["gpipe"]["same"]
        assert same.startswith("BatchMismatchError: every one of the 2 data-parallel replicas was given the same "
                               "batch") and "pipe.shard(global_batch)" in same, same
        assert got["bn"].startswith("MutationError: the model updates buffers in its forward ('net.1.running_mean'"), \
            got["bn"]
        eager = got["gpipe"]["eager"]
        assert eager.startswith("DistributedError: TinyGPT was called eagerly on this rank") and \
            "was released to the meta device" in eager, eager
        drift, named, held = got["gpipe"]["drift"]
        assert drift.startswith("ReplicaWeightsError: the weights of pipeline position 0") and \
            "ranks 0; rank 2" not in drift and "rank 0; rank 2 each hold other values" in drift, drift
        assert held == (0, 2)
        assert named == (r in (0, 2)), r  # the ranks holding the copies name the weight
        assert got["gpipe"]["drift_fixed"] > 0
        failed = got["gpipe"]["failed"]
        if r == 3:
            assert failed.startswith("BatchShapeError: target must be a tensor"), failed
        else:
            assert failed.startswith("PeerFailedError: rank 3 could not check its batch"), failed


@pytest.mark.slow
def test_replicas_under_1f1b_and_zbv(tmp_path: Path) -> None:
    ranks = run_ranks(_ddp_worker, 4, ([("1f1b", 1), ("zbv", 2)], 2), tmp_path)
    _check(ranks, "1f1b")
    _check(ranks, "zbv")


def _fsdp_worker(rank: int, world: int, port: int, schedules: list, out: str) -> None:
    _ddp_worker(rank, world, port, schedules, 2, out, data_parallel="fsdp")


def test_replicas_sharded_by_fsdp_train_as_eager_on_the_global_batch(tmp_path: Path) -> None:
    """'fsdp': each rank holds about half of its stages' parameters, and the same trajectory."""
    ranks = run_ranks(_fsdp_worker, 4, ([("1f1b", 1)],), tmp_path)
    _check(ranks, "1f1b", data_parallel="fsdp")
    for got in ranks:
        eager = got["1f1b"]["eager"]
        assert eager.startswith("DistributedError: TinyGPT was called eagerly on this rank") and \
            ("is this rank's shard of it (data_parallel='fsdp')" in eager or "released to the meta device" in eager) \
            and "pipe.eval_step" in eager, eager
        shard, whole_stage = got["1f1b"]["held"]
        assert shard <= whole_stage // 2 + 64, (shard, whole_stage)  # dim-0 shards: at most one row more
        again = got["1f1b"]["again"]
        assert again.startswith("DistributedError: the model's parameters (") and "data_parallel='fsdp'" in again, \
            again


@pytest.mark.slow
def test_fsdp_under_gpipe_and_two_stages_per_rank(tmp_path: Path) -> None:
    """Two FSDP roots on a rank: zbv puts the tied embedding and LM head on one rank (left whole
    on every replica, summed over them), interleaved 1F1B on two (each rank's shard summed)."""
    ranks = run_ranks(_fsdp_worker, 4, ([("gpipe", 1), ("zbv", 2), ("interleaved1f1b", 2)],), tmp_path)
    for schedule in ("gpipe", "zbv", "interleaved1f1b"):
        _check(ranks, schedule, data_parallel="fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_eight_ranks_as_replicas_of_pipelines(dp: int, tmp_path: Path) -> None:
    """2 replicas x 4 pipeline ranks and 4 x 2, gpipe: exact on the global batch."""
    ranks = run_ranks(_ddp_worker, 8, ([("gpipe", 1)], dp), tmp_path, seconds=SLOW_SPAWN_SECONDS)
    _check(ranks, "gpipe", dp)


def _resume_worker(rank: int, world: int, port: int, data_parallel: str, out: str) -> None:
    """Two steps on 2 replicas x 2 pipeline ranks, saved with torch.distributed.checkpoint;
    resumed by a fresh model in another layout (one 4-rank pipeline, no replicas) for a third."""
    import torch.distributed.checkpoint as dcp

    import fxpipe.distributed as fpd

    mesh = _join(rank, world, port)
    x, y = global_batch()
    model, _, _, loss_fn, _ = case("gpt", 2)
    pipe = fpd.pipeline(model, pipe_sample(x), chunks=2, loss_fn=loss_fn, mesh=mesh, data_parallel=data_parallel,
                        timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    losses = []
    for _ in range(2):
        losses.append(float(pipe.step(pipe.shard(x), target=pipe.shard(y))))
        opt.step()
        opt.zero_grad()
    dcp.save({"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(opt)}, checkpoint_id=str(Path(out) / "ckpt"))
    pipe.close()
    fresh, *_ = case("gpt", 2)
    again = fpd.pipeline(fresh, x, chunks=2, loss_fn=loss_fn, timeout=60)  # 4 stages, the global batch on each rank
    opt = torch.optim.AdamW(again.parameters(), **ADAM)
    state = {"model": again.state_dict(), "optim": again.optimizer_state_dict(opt)}
    dcp.load(state, checkpoint_id=str(Path(out) / "ckpt"))
    again.load_state_dict(state["model"])
    again.load_optimizer_state_dict(opt, state["optim"])
    losses.append(float(again.step(x, target=y)))
    opt.step()
    params = {n: p.detach().clone() for n, p in again.named_parameters()}
    again.close()
    torch.save({"losses": losses, "params": params}, Path(out) / f"rank{rank}.pt")
    _leave()


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_a_checkpoint_of_replicas_resumes_in_another_layout(data_parallel: str, tmp_path: Path) -> None:
    ranks = run_ranks(_resume_worker, 4, (data_parallel,), tmp_path)
    model, _, _, loss_fn, _ = case("gpt", 2)
    x, y = global_batch()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for _ in range(3):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    want = dict(model.named_parameters())
    held = set()
    for got in ranks:
        for a, b in zip(got["losses"], losses, strict=True):
            assert_close_scaled(torch.tensor(a), torch.tensor(b), what="loss")
        for name, p in got["params"].items():
            assert_close_scaled(p, want[name].detach(), {"atol": 1e-2 * LR}, what=name)
            held.add(name)
    assert held == set(want)  # every parameter resumed on some rank


def llama_batch() -> tuple[torch.Tensor, dict]:
    """A global batch of 8 for the tiny Llama trained by its own ``labels=`` loss: padded rows
    in the first replica's half, more padding in the second's (another count of labels)."""
    from hf_families import ids, padded_labels, padding_mask

    x = ids(batch=8)
    mask = padding_mask(batch=8)
    mask[5, 4:] = 0
    mask[6, 6:] = 0
    return x, {"attention_mask": mask, "labels": padded_labels(x, mask)}


def _llama_worker(rank: int, world: int, port: int, weights: str, data_parallel: str, out: str) -> None:
    """The tiny Llama built on meta, each rank loading its stages' keys from ``weights``: 3 SGD
    steps of 2 replicas x 2 pipeline ranks under 1f1b on their shards, what each rank holds."""
    import fxpipe.distributed as fpd
    from test_distributed_meta import LlamaLabels, _optimizer

    mesh = _join(rank, world, port)
    x, kwargs = llama_batch()
    with torch.device("meta"):
        model = LlamaLabels()
    originals = dict(model.named_parameters())
    pipe = fpd.pipeline(model, (x[:4],), sample_kwargs={k: v[:4] for k, v in kwargs.items()}, chunks=2,
                        schedule="1f1b", mesh=mesh, data_parallel=data_parallel, state_dict=weights, timeout=60)
    # the model's parameters as built on meta: given whole storage in place ('ddp'), or never ('fsdp': each
    # rank's shards are new DTensors, each given only its slice)
    materialised = {n for n, p in originals.items() if not p.is_meta}
    opt = _optimizer(pipe.parameters())
    steps = []
    for _ in range(3):
        loss = pipe.step(pipe.shard(x), **pipe.shard(kwargs))
        steps.append({"loss": float(loss), "grads": {n: whole(p.grad) for n, p in pipe.named_parameters()}})
        opt.step()
        opt.zero_grad()
    held = {n for n, p in model.named_parameters() if not p.is_meta}
    torch.save({"steps": steps, "held": held, "materialised": materialised, "mine": {n for n, _ in pipe.named_parameters()},
                "params": {n: whole(p.detach()) for n, p in pipe.named_parameters()}}, Path(out) / f"rank{rank}.pt")
    pipe.close()
    _leave()


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_a_meta_llama_trains_by_its_own_labels_loss_as_eager_on_the_global_batch(data_parallel: str,
                                                                                  tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_distributed_meta import LlamaLabels, _optimizer

    torch.manual_seed(0)
    model = LlamaLabels()
    if data_parallel == "fsdp":  # a torch.distributed.checkpoint directory: each rank reads only its slices
        import torch.distributed.checkpoint as dcp

        weights = tmp_path / "weights"
        dcp.save(model.state_dict(), checkpoint_id=str(weights), no_dist=True)
    else:
        weights = tmp_path / "weights.pt"
        torch.save(model.state_dict(), weights)
    ranks = run_ranks(_llama_worker, 4, (str(weights), data_parallel), tmp_path)
    x, kwargs = llama_batch()
    opt = _optimizer(model.parameters())
    want = []
    for _ in range(3):
        loss = model(x, **kwargs).loss
        loss.backward()
        want.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
    for r, got in enumerate(ranks):
        assert got["held"] == got["mine"], "a rank materialised more than its stages"
        assert got["materialised"] == (got["mine"] if data_parallel == "ddp" else set()), got["materialised"]
        assert got["mine"] == ranks[r ^ 2]["mine"]  # the replica of a rank holds the same stages
        for i, (a, b) in enumerate(zip(got["steps"], want, strict=True)):
            assert_close_scaled(torch.tensor(a["loss"]), torch.tensor(b["loss"]), what=f"loss {i}")
            for name, g in a["grads"].items():
                assert_close_scaled(g, b["grads"][name], what=f"step {i} {name} on rank {r}")
        for name, p in got["params"].items():
            assert_close_scaled(p, dict(model.named_parameters())[name].detach(), what=name)
