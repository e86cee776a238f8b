"""-100 labels (ignored by a cross entropy) in a distributed step's target: each micro-batch's
mean loss is weighted 1/chunks, which is eager's mean over the counted labels only when every
micro-batch counts as many. Unequal counts are refused (MicroBatchError), equal ones are exact.
World size 1, in this process (two stages on the rank)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zoo
from dist_models import _gpt_loss
from exact import assert_close_scaled, largest
from fxpipe.distributed._launch import free_port
from fxpipe.distributed._pipe import check_counted_labels
from fxpipe.errors import MicroBatchError


def test_counts_per_micro_batch_decide() -> None:
    y = torch.tensor([[1, 2, -100, -100], [3, -100, 4, 5], [5, 6, 7, -100], [-100, -100, 2, 3]])
    check_counted_labels(y, 1)  # one micro-batch: its mean is the batch's
    check_counted_labels(y, 2)  # 5 and 5 counted
    with pytest.raises(MicroBatchError, match=r"counted labels per micro-batch: \[2, 3, 3, 2\].*reduction='sum'"):
        check_counted_labels(y, 4)
    check_counted_labels(y.float(), 4)  # a float target: no labels to ignore
    check_counted_labels(y.clamp(min=0), 4)


def test_a_step_is_exact_with_equal_counts_and_refused_with_unequal_ones() -> None:
    import fxpipe.distributed as fpd

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model, (x,), _ = zoo.gpt_tied(batch=4)
        eager = zoo.TinyGPT()
        eager.load_state_dict(model.state_dict())
        y = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        y[:, -3:] = -100  # 13 counted labels in each sample
        pipe = fpd.pipeline(model, x, chunks=2, loss_fn=_gpt_loss, schedule="zbv", stages_per_rank=2, timeout=60)
        loss = pipe.step(x, target=y)
        want = _gpt_loss(eager(x), y)
        want.backward()
        assert_close_scaled(loss, want.detach(), None, what="loss")
        top = max(largest(p.grad) for p in eager.parameters())
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_close_scaled(p.grad, q.grad, None, what=f"grad {n}", floor_of=top)
        y[0, :8] = -100  # micro-batch 0 now counts fewer
        before = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(MicroBatchError, match=r"\[18, 26\]"):
            pipe.step(x, target=y)
        assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))  # refused before running
        assert pipe.step(x, target=y.clamp(min=0)).dim() == 0  # the pipeline still runs
        pipe.close()
    finally:
        dist.destroy_process_group()
