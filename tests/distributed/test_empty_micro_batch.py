"""A micro-batch whose loss counts nothing (all masked out, or targets whose class weights are
0) on 2 gloo ranks: its loss is ``sum / 0``, and a zero gradient through it was nan in every
parameter. Weighed 0, it is backwarded through the stage's other outputs only: the gradients
equal eager's on the whole batch, for the model's own loss and for a ``loss_fn``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from exact import assert_close_scaled
from zoo import MaskedMeanLM


WEIGHTS = torch.ones(20)
WEIGHTS[0] = 0  # the pad class


def class_weighted(out: dict, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"].flatten(0, 1), y.flatten(), weight=WEIGHTS)


def _data(empty: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``empty``: the first row counting nothing (2: the second micro-batch; 0: the whole batch)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (4, 5), generator=g)
    mask = torch.ones(4, 5)
    mask[empty:] = 0
    y = ids.clone()
    y[empty:] = 0
    return ids, mask, y


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result = {}
    for kind, empty in KINDS:
        ids, mask, y = _data(empty)
        torch.manual_seed(1)
        pipe = fpd.pipeline(MaskedMeanLM(), _data()[:2], chunks=2, loss_fn=class_weighted if kind == "loss_fn" else None,
                            output_merge={"loss": "mean", "logits": 0}, timeout=60)
        loss = pipe.step(ids, mask, target=y) if kind == "loss_fn" else pipe.step(ids, mask)
        result[kind, empty] = (loss, {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        pipe.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


KINDS = [(kind, empty) for kind in ("own", "loss_fn") for empty in (2, 0)]


def test_a_micro_batch_counting_nothing_gives_eagers_gradients(tmp_path: Path) -> None:
    """And a batch counting nothing at all gives eager's ``0 / 0``: a nan loss, and the gradients
    eager's backward of it gives (it gave 0 and zero gradients: a review)."""
    ranks = run_ranks(_worker, 2, (), tmp_path)
    for kind, empty in KINDS:
        ids, mask, y = _data(empty)
        torch.manual_seed(1)
        model = MaskedMeanLM()
        out = model(ids, mask)
        want = class_weighted(out, y) if kind == "loss_fn" else out["loss"]
        want.backward()
        eager = dict(model.named_parameters())
        held = set()
        for got in ranks:
            loss, grads = got[kind, empty]
            for name, g in grads.items():
                held.add(name)
                if empty == 0:  # nan where eager's is
                    torch.testing.assert_close(g, eager[name].grad, equal_nan=True, msg=f"{kind}: grad {name}")
                    continue
                assert torch.isfinite(g).all(), f"{kind}: {name}"
                assert_close_scaled(g, eager[name].grad, what=f"{kind}: grad {name}")
            if loss is None:
                continue  # None where no stage holds the loss
            if empty == 0:
                assert want.isnan() and loss.isnan(), (kind, loss)
            else:
                assert_close_scaled(loss, want.detach(), what=f"{kind} loss")
        assert held == set(eager), (kind, empty)
