"""Gradient accumulation over several ``step()`` calls stays exact on a dp x pp mesh when
something between them makes torch run a schedule for the first time or run a forward-only one:

* ``eval_step`` between two accumulated steps: torch's forward-only schedule still calls
  ``perform_reduce_grad(n_microbatches)`` at its end, which divided every accumulated ``.grad``
  by ``chunks`` (any layout, measured: 1.5x one step's gradient after step, eval_step, step);
* a new micro-batch shape (a new sequence length) under ``'fsdp'``: torch's schedule calls
  ``_post_metadata_inference_cleanup`` at a new stage's first step, which set every FSDP
  parameter's ``.grad`` to None (the earlier steps' sharded gradients dropped);
* a new shape first run by ``eval_step``: its metadata, made under ``no_grad``, gave the
  shape's receive buffers no gradient, and the next step there failed inside torch.

The embedding is tied to the head, on the first and last pipeline rank: under ``'fsdp'`` its
sharded copies' gradients are summed over them (they were not, once sharding had replaced the
parameters the ties were found by).

4 gloo ranks (2 replicas x 2 pipeline ranks); the parent compares with eager on the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import run_ranks
from exact import assert_close_scaled
from test_data_parallel import _join, _leave, whole


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 11)
        self.head.weight = self.emb.weight  # tied: on the first and the last pipeline rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # stops torch.fx: a torch.export capture, whose stages hold modules of their own
            raise ValueError("expected token ids of shape (batch, length)")
        h = torch.tanh(self.l1(self.emb(x)))
        return self.head(torch.tanh(self.l3(torch.tanh(self.l2(h)))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two global batches of 8 sequences, of lengths 6 and 9; replica 1 ignores more labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for length in (6, 9):
        x = torch.randint(0, 11, (8, length), generator=g)
        y = torch.randint(0, 11, (8, length), generator=g)
        y[4:, 2:] = -100
        out.append((x, y))
    return out


#: the calls of each case: ("step", batch) or ("eval", batch), no zero_grad in between; chunks
CASES = {
    "ddp eval_step between": ("ddp", [("step", 0), ("eval", 0), ("step", 0)], 2),
    "fsdp eval_step between": ("fsdp", [("step", 0), ("eval", 0), ("step", 0)], 2),
    "fsdp new length": ("fsdp", [("step", 0), ("step", 1)], 2),
    # a length eval_step (under no_grad) brings first, then trained at
    "ddp eval_step at a new length": ("ddp", [("step", 0), ("eval", 1), ("step", 1)], 2),
    # one micro-batch per replica: still weighed by its count of labels (it was by 1/dp)
    "ddp one micro-batch": ("ddp", [("step", 0)], 1),
}


def _with_z_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token mean plus a mean over every position (a z-loss): two means over two counts."""
    return _loss(out, y) + 1e-2 * out.logsumexp(-1).pow(2).mean()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import fxpipe.distributed as fpd
    from fxpipe.errors import DistributedError

    mesh = _join(rank, world, port)
    batches = _batches()
    result = {}
    for name, (data_parallel, calls, chunks) in CASES.items():
        torch.manual_seed(0)
        model = Tokens()
        early = torch.optim.SGD(model.parameters(), lr=0.1)  # made before the build
        pipe = fpd.pipeline(model, batches[0][0][:4], chunks=chunks, loss_fn=_loss,
                            schedule="1f1b" if chunks > 1 else "gpipe", mesh=mesh, data_parallel=data_parallel,
                            timeout=60)
        for kind, b in calls:
            x, y = batches[b]
            if kind == "step":
                pipe.step(pipe.shard(x), target=pipe.shard(y))
            else:
                pipe.eval_step(pipe.shard(x))
        result[name] = {n: whole(p.grad) for n, p in pipe.named_parameters()}
        try:  # 'ddp' trains the model's own parameters; 'fsdp' replaced them by shards: refused
            early.step()
            result[name + ": early optimizer"] = "ran"
        except DistributedError as e:
            result[name + ": early optimizer"] = str(e)
        if name == "ddp one micro-batch":  # the z-loss's count is another share of each replica's labels
            from fxpipe.errors import StepError

            again = fpd.pipeline(Tokens(), batches[0][0][:4], chunks=2, loss_fn=_with_z_loss, schedule="1f1b",
                                 mesh=mesh, data_parallel="ddp", timeout=60)
            try:
                again.step(again.shard(batches[0][0]), target=again.shard(batches[0][1]))
                result["z-loss"] = "ran"
            except StepError as e:  # on every rank, before anything was sent: the pipeline goes on
                result["z-loss"] = str(e)
                x, y = batches[0]
                result["z-loss after"] = float(again.step(again.shard(x), target=again.shard(y.clamp(min=0))))
            again.close()
        pipe.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    _leave()


def _eager(calls: list) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Tokens()
    batches = _batches()
    for kind, b in calls:
        if kind == "step":
            x, y = batches[b]
            _loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_accumulated_gradients_survive_eval_step_and_a_new_length(tmp_path: Path) -> None:
    ranks: list[Any] = run_ranks(_worker, 4, (), tmp_path)
    for got in ranks:
        assert got["z-loss"].startswith("loss_fn adds means over different counts") and \
            "the data-parallel replicas count them in other proportions" in got["z-loss"], got["z-loss"]
        assert got["z-loss after"] > 0  # without ignored labels the counts agree: it trains
    for name, (data_parallel, calls, _) in CASES.items():
        for got in ranks:
            early = got.pop(name + ": early optimizer")
            if data_parallel == "ddp":
                assert early == "ran", early
            else:
                assert "holds 'emb.weight' as it was before a fxpipe.distributed pipeline with data_parallel='fsdp' " \
                       "sharded it" in early, early
        want = _eager(calls)
        for r, got in enumerate(ranks):
            assert got[name], f"{name}: no gradient on rank {r}"
            for n, g in got[name].items():
                assert_close_scaled(g, want[n], what=f"{name}: grad {n} on rank {r}")
