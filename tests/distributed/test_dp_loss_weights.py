"""Replicas given batches of other shapes, and a loss weighed by samples: exact or refused.

A step's loss is weighed by what its code divides by where fxpipe reads it, else by each
micro-batch's samples. A trial (2 replicas x 2 pipeline ranks, 'ddp' and 'fsdp') found two
silent results there:

* the model's own plain mean (``F.mse_loss`` in its forward, ``loss_fn=None``) counted every
  micro-batch alike, whatever its rows: replicas of 4 and 2 rows gave the mean of the two
  replicas' means (28.53 against eager's 21.31 on the 6-row global batch);
* a mean over every position (``.mean()`` of a per-token value) weighed by rows while the
  replicas' sequences had other lengths (259.61 against 255.08).

Now the own mean is weighed by rows (exact), and a mean weighed by samples whose replicas hold
samples of other shapes (targets, or the outputs where there are none) is refused on every rank
before anything is sent; a mean over samples of another length per replica (a pooled
regression) is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import run_ranks
from exact import assert_close_scaled
from test_data_parallel import _join, _leave


class Regress(nn.Module):
    """A regression returning its own mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict:
        pred = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return {"loss": F.mse_loss(pred, target), "pred": pred}


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(self.emb(ids))))


class Scores(nn.Module):
    """A score per position; the loss pools it per sequence (a regression head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _pooled_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.mean(1).squeeze(-1), y)


def _sequences(length: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, length, 8, generator=g), torch.randn(4, generator=g)


def _position_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.logsumexp(-1) - y.float()).pow(2).mean()


def _rows() -> list:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g) * 3),
            (torch.randn(2, 8, generator=g), torch.randn(2, 3, generator=g) * 3 + 5)]


def _tokens(length: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (4, length), generator=g), torch.randint(0, 4, (4, length), generator=g)


def _worker(rank: int, world: int, port: int, data_parallel: str, out: str) -> None:
    import fxpipe.distributed as fpd
    from fxpipe.errors import StepError

    mesh = _join(rank, world, port)
    result: dict = {}
    rows = _rows()
    pipe = fpd.pipeline(Regress(), rows[0], chunks=2, mesh=mesh, data_parallel=data_parallel, timeout=60,
                        progress=False)
    x, y = rows[pipe.dp_rank]
    result["loss"] = float(pipe.step(x, y))
    result["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                       for n, p in pipe.named_parameters() if p.grad is not None}
    pipe.close()
    tokens = fpd.pipeline(Tokens(), _tokens(6, 0)[0], chunks=2, loss_fn=_position_mean, schedule="1f1b", mesh=mesh,
                          data_parallel=data_parallel, timeout=60, progress=False)
    ids, y = _tokens(6 if tokens.dp_rank == 0 else 5, tokens.dp_rank)
    try:
        tokens.step(ids, target=y)
        result["lengths"] = "ran"
    except StepError as e:  # on every rank, before anything was sent: the pipeline goes on
        result["lengths"] = str(e)
        ids, y = _tokens(6, tokens.dp_rank)  # one length: weighed by samples, exact
        result["after"] = float(tokens.step(ids, target=y))
    tokens.close()
    # a mean over samples (a pooled regression) from sequences of another length per replica: exact
    scores = fpd.pipeline(Scores(), _sequences(6, 0)[0], chunks=2, loss_fn=_pooled_mse, mesh=mesh,
                          data_parallel=data_parallel, timeout=60, progress=False)
    x, y = _sequences(6 if scores.dp_rank == 0 else 4, 1 + scores.dp_rank)
    result["pooled"] = float(scores.step(x, target=y))
    result["pooled grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                              for n, p in scores.named_parameters() if p.grad is not None}
    scores.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    _leave()


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_replicas_of_other_shapes_are_weighed_exactly_or_refused(data_parallel: str, tmp_path: Path) -> None:
    ranks: list[Any] = run_ranks(_worker, 4, (data_parallel,), tmp_path)
    model = Regress()
    rows = _rows()
    loss = model(torch.cat([rows[0][0], rows[1][0]]), torch.cat([rows[0][1], rows[1][1]]))["loss"]
    loss.backward()
    pooled = Scores()
    (x0, y0), (x1, y1) = _sequences(6, 1), _sequences(4, 2)
    want = (_pooled_mse(pooled(x0), y0) + _pooled_mse(pooled(x1), y1)) / 2  # 4 samples each
    want.backward()
    for got in ranks:
        assert_close_scaled(torch.tensor(got["pooled"]), want.detach(), what="pooled loss")
        for name, g in got["pooled grads"].items():
            assert_close_scaled(g, dict(pooled.named_parameters())[name].grad, what=f"pooled {name}")
        assert_close_scaled(torch.tensor(got["loss"]), loss.detach(), what="loss")
        for name, g in got["grads"].items():
            assert_close_scaled(g, dict(model.named_parameters())[name].grad, what=name)
        assert "other shapes beyond the batch dim" in got["lengths"], got["lengths"]
        assert got["after"] > 0


def test_a_global_batch_that_does_not_split_over_the_replicas_is_a_batch_shape_error() -> None:
    # a trial: a bare ValueError on every rank
    from fxpipe.distributed._mesh import Layout, shard
    from fxpipe.errors import BatchShapeError

    layout = Layout(None, None, None, [[0, 1], [2, 3]], 1, "ddp")  # type: ignore[arg-type]
    assert torch.equal(shard(torch.arange(8), layout), torch.arange(4, 8))
    with pytest.raises(BatchShapeError, match="does not split into 2 equal replica shares"):
        shard(torch.arange(7), layout)


class OwnPositionMean(nn.Module):
    """Its own loss a mean over every position of its labels; it returns a pooled score only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
        h = self.a(x).squeeze(-1)
        return (h - labels).pow(2).mean(), h.mean(1)


def test_the_own_losss_labels_say_what_its_mean_is_over() -> None:
    # returned a per-sample score only, its outputs looked alike across lengths: its labels do not
    from fxpipe.distributed._loss_shapes import loss_only_inputs, own_loss_key

    graph = torch.fx.symbolic_trace(OwnPositionMean()).graph
    assert loss_only_inputs(graph, 0) == [1]  # the labels: read by the loss alone
    assert loss_only_inputs(graph, 1) == []
    pooled = torch.zeros(4)
    six, five = own_loss_key((), [pooled], [torch.zeros(4, 6)]), own_loss_key((), [pooled], [torch.zeros(4, 5)])
    assert six != five
    assert own_loss_key((), [pooled], [torch.zeros(4)]) == own_loss_key((), [pooled], [torch.ones(4)])
