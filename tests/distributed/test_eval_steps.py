"""Validation between training steps, as loops do it (a new-user trial on gloo ranks):

* a second ``eval_step`` of one shape with two stages per rank (zbv, interleaved, looped gpipe)
  failed inside torch ("Recv twice ... without executing backward") and killed the pipeline:
  the forward-only schedule now drops the backward transfers torch lowered into it;
* an ``eval_step`` under ``torch.inference_mode()`` at a new length made that shape's stages
  without gradients, and the next ``step`` at that length failed in torch's stage backward;
* a second pipeline built from the model with another layout released weights the first one's
  stages held: its next step failed with a bare "Tensor on device meta"; now a typed refusal on
  every rank.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
from dist_harness import run_ranks


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import fxpipe.distributed as fpd
    from fxpipe.errors import PeerFailedError, PipelineClosedError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(13, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 13))
    eager = copy.deepcopy(model)

    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    def batch(length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 13, (4, length), generator=g), torch.randint(0, 13, (4, length), generator=g)

    said = []
    pipe = fpd.pipeline(model, batch(6, 0)[0], chunks=2, loss_fn=loss_fn, schedule="zbv", stages_per_rank=2,
                        timeout=60)
    assert pipe.eval() is pipe and not model.training  # as fxpipe.Pipeline: the model's mode
    for seed in (1, 2):  # two validation batches of one shape
        x, y = batch(6, seed)
        with torch.no_grad():
            said.append((float(pipe.eval_step(x, target=y)), float(loss_fn(eager(x), y))))
    pipe.train()
    x, y = batch(5, 3)  # a length not seen yet, validated under inference_mode, then trained on
    with torch.inference_mode():
        said.append((float(pipe.eval_step(x, target=y)), float(loss_fn(eager(x), y))))
    loss = pipe.step(x, target=y)
    want = loss_fn(eager(x), y)
    want.backward()
    said.append((float(loss), float(want)))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    worst = max(float((grads[n] - q.grad).abs().max()) for n, q in eager.named_parameters() if n in grads)
    other = fpd.pipeline(model, batch(6, 0)[0], chunks=2, loss_fn=loss_fn, schedule="1f1b", timeout=60)
    try:
        pipe.step(x, target=y)
        refused = ""
    except (PipelineClosedError, PeerFailedError) as e:  # the rank whose weights went, and its peer
        refused = str(e)
    other.close()
    pipe.close()
    torch.save((said, worst, refused), Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_validation_between_steps_under_a_v_schedule(tmp_path: Path) -> None:
    for said, worst, refused in run_ranks(_worker, 2, (), tmp_path):
        for got, want in said:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want))
        assert worst < 1e-5
        assert "were released to meta since its build" in refused
