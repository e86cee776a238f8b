"""``fxpipe.distributed`` through a training run: clipping by the global norm, tied copies that
drifted apart refused (issue #30). Two gloo ranks on 127.0.0.1; each rank saves what it saw to
``rank{r}.pt`` and the parent compares it with eager's run of the same steps."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import torch

from dist_harness import run_ranks
from dist_models import case
from exact import assert_close_scaled

STEPS = 3
LR = 1e-2


def _clip_worker(rank: int, world: int, port: int, out: str) -> None:
    """The tied GPT over 2 ranks (the embedding on rank 0, the LM head on rank 1), AdamW with
    ``pipe.clip_grad_norm_`` for STEPS steps (2-norm, then inf-norm), then torch's per-rank
    clipping, which the next step refuses."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.errors import TiedWeightsError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("gpt", 2)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(pipe.step(x, target=y))
        norms.append(pipe.clip_grad_norm_(0.05, norm_type=2.0 if step < STEPS - 1 else float("inf")))
        opt.step()
        opt.zero_grad()
    result = {"losses": losses, "norms": norms,
              "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}
    pipe.step(x, target=y)
    torch.nn.utils.clip_grad_norm_(list(pipe.parameters()), 1e-4)  # each rank by its own norm
    opt.step()
    opt.zero_grad()
    try:
        pipe.step(x, target=y)
        result["drift"] = "ran"
    except TiedWeightsError as e:
        result["drift"] = (str(e), e.parameter, e.ranks)
    pipe.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_global_clipping_is_eagers_and_tied_copies_that_drift_are_refused(tmp_path: Path) -> None:
    ranks = run_ranks(_clip_worker, 2, (), tmp_path)
    model, x, y, loss_fn, _ = case("gpt", 2)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_fn(ref(x), y)
        loss.backward()
        losses.append(loss.detach())
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05,
                                                    norm_type=2.0 if step < STEPS - 1 else float("inf")))
        opt.step()
        opt.zero_grad()
    want = dict(ref.named_parameters())
    for r in ranks:
        for got, expected in zip(r["losses"], losses):
            assert_close_scaled(got, expected, what="loss")
        for got, expected in zip(r["norms"], norms):  # the whole model's norm on every rank
            assert_close_scaled(got, expected, what="norm")
        for name, value in r["params"].items():  # Adam divides by sqrt(v): where a gradient is near 0,
            # its rounding moves the update by a share of lr (1% of one step's update allowed)
            assert_close_scaled(value, want[name].detach(), {"atol": 1e-2 * LR}, what=name)
    tied = [r["drift"] for r in ranks]
    for message, parameter, holders in tied:  # refused on both ranks, naming the tied weight
        assert "holds other values on ranks 0, 1" in message and "pipe.clip_grad_norm_" in message, message
        assert parameter == "tok.weight" and holders == (0, 1)
