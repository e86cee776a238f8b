"""``fxpipe.distributed``: one pipeline for every sequence length and every batch size that
``chunks`` divides (issue #31). Two gloo ranks on 127.0.0.1 train a transformers GPT-2 (a
torch.export capture, its own ``labels=`` loss with ``-100`` padding) on batches of another
length each step and a smaller last batch, under three schedules; the parent compares every
loss and every parameter after 3 AdamW steps with eager's run of the same batches. Ranks given
different lengths are refused on both, and the pipeline goes on; a length past the model's
``n_positions`` fails with the model's own error, named on every rank."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_harness import run_ranks  # noqa: E402
from exact import assert_close_scaled  # noqa: E402
from hf_families import VOCAB, no_dropout  # noqa: E402

#: (batch, length) of each step: another length each time, the last batch smaller
SHAPES = ((4, 8), (4, 13), (2, 6))
ADAM = {"lr": 1e-2, "eps": 1e-6}


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(no_dropout(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64))).train()


def _batch(step: int, batch: int, length: int) -> dict:
    """Right-padded rows: the mask's zeros, and ``-100`` labels there, at a length per row."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch, 2):
        mask[row, length - 1 - row:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _worker(rank: int, world: int, port: int, schedule: str, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.errors import BatchMismatchError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    stages_per_rank = 2 if schedule == "zbv" else 1
    pipe = fpd.pipeline(_gpt2(), (), sample_kwargs=_batch(99, 4, 8), chunks=2, schedule=schedule,
                        stages_per_rank=stages_per_rank, timeout=60, progress=False)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    losses, evaluated = [], None
    for step, (batch, length) in enumerate(SHAPES):
        if step == 1:  # eval_step brings this shape first (under no_grad): step() must still train at it
            evaluated = pipe.eval_step(**_batch(step, batch, length))
        losses.append(pipe.step(**_batch(step, batch, length)))
        opt.step()
        opt.zero_grad()
    result = {"losses": losses, "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
              "runs": pipe._runs.made, "evaluated": evaluated}
    try:  # each rank another length: refused on both before anything is sent
        pipe.step(**_batch(7, 4, 9 + rank))
        result["mismatch"] = "ran"
    except BatchMismatchError as e:
        result["mismatch"] = str(e)
    result["after"] = pipe.eval_step(**_batch(8, 2, 11))  # the pipeline still runs
    try:  # past n_positions: the model's own error, by its own type on the failing rank
        pipe.step(**_batch(9, 2, 70))
    except Exception as e:  # noqa: BLE001 - recorded, compared by the parent
        result["too_long"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    torch.save(result, Path(out) / f"rank{rank}.pt")  # the step that failed midway left no group to leave


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow),
                                      pytest.param("zbv", marks=pytest.mark.slow)])  # 30 s each on 2 cores
def test_a_length_per_step_and_a_smaller_last_batch_train_as_eager(tmp_path: Path, schedule: str) -> None:
    ranks = run_ranks(_worker, 2, (schedule,), tmp_path)
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for step, (batch, length) in enumerate(SHAPES):
        loss = model(**_batch(step, batch, length)).loss
        loss.backward()
        losses.append(loss.detach())  # no dropout: eval_step's loss before the step is this one
        opt.step()
        opt.zero_grad()
    want = dict(model.named_parameters())
    with torch.no_grad():
        after = copy.deepcopy(model).eval()(**_batch(8, 2, 11)).loss  # no dropout: eval as train
    for r in ranks:
        for got, expected in zip(r["losses"], losses, strict=True):
            assert_close_scaled(got, expected, what="loss")
        assert_close_scaled(r["evaluated"], losses[1], what="eval_step's loss at a shape it brought first")
        assert r["params"], "each rank trains some parameters"
        for name, value in r["params"].items():  # Adam's update where a gradient is ~0: a share of lr
            assert_close_scaled(value, want[name].detach(), {"atol": 1e-2 * ADAM["lr"]}, what=name)
        assert r["runs"] == len(SHAPES), "one set of torch stages per micro-batch shape, nothing else rebuilt"
        assert "different batches" in r["mismatch"] and "their batches hold 108 elements on rank 0, " \
            "120 elements on rank 1: another length" in r["mismatch"], r["mismatch"]
        assert_close_scaled(r["after"], after, what="eval loss")
    assert ranks[0]["too_long"].startswith("IndexError: index out of range"), ranks[0]["too_long"]
    assert ranks[1]["too_long"].startswith("PeerFailedError: stopped because another rank failed: rank 0: "
                                           "IndexError"), ranks[1]["too_long"]


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    """2 replicas x 2 pipeline ranks, 'fsdp', the tied GPT-2 (embedding on the first rank, head
    on the last): each replica steps on its half of each global batch, an eval_step between."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pipe = fpd.pipeline(_gpt2(), (), sample_kwargs=_batch(99, 4, 8), chunks=2, schedule="1f1b", mesh=mesh,
                        data_parallel="fsdp", timeout=60, progress=False)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    losses = []
    for step, (batch, length) in enumerate(FSDP_SHAPES):
        losses.append(pipe.step(**pipe.shard(_batch(step, batch, length))))
        opt.step()
        opt.zero_grad()
        if step == 0:
            pipe.eval_step(**pipe.shard(_batch(8, 4, 11)))
    torch.save({"losses": losses}, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


#: global batches of the sharded replicas: another length each step, the last batch smaller
FSDP_SHAPES = ((8, 8), (8, 13), (4, 6))


@pytest.mark.slow
def test_a_tied_gpt2_sharded_over_replicas_trains_as_eager_at_each_length(tmp_path: Path) -> None:
    """The tied weight's gradient summed over the two pipeline ranks of each replica under
    'fsdp' (it was not, once sharding had replaced the parameters: from the second step on the
    loss was another)."""
    ranks = run_ranks(_fsdp_worker, 4, (), tmp_path)
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    for step, (batch, length) in enumerate(FSDP_SHAPES):
        loss = model(**_batch(step, batch, length)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        for r in ranks:
            assert_close_scaled(r["losses"][step], loss.detach(), what=f"loss of step {step}")


def test_a_0_dim_tensor_input_is_named_as_such_not_as_a_batch_size() -> None:
    """The HF Trainer's ``num_items_in_batch`` as a 0-dim tensor was told to make its last batch
    a multiple of chunks (a trial): torch's schedules split every tensor input along dim 0."""
    from fxpipe.distributed._shape_runs import micro_batch
    from fxpipe.errors import BatchShapeError

    ids = torch.zeros(8, 12, dtype=torch.long)
    with pytest.raises(BatchShapeError, match=r"one of them 0-dim .*num_items_in_batch") as info:
        micro_batch([ids, ids, torch.tensor(40)], 4)
    assert "multiple of" not in str(info.value)
    assert [x.shape[0] for x in micro_batch([ids, ids, 3], 4)[:2]] == [2, 2]
