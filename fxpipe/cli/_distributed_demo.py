"""``fxpipe demo --nproc N`` on each rank: the demo's U-Net trained by ``fxpipe.distributed``,
checked against eager.

Every rank builds the same U-Net (:func:`fxpipe.cli._demo.make_unet`: long skips, which become
portals carried across ranks) and the pipeline; each runs ``--steps`` training steps with SGD
(momentum) on its own parameters. Rank 0 also keeps an untouched copy of the model and trains
it eagerly on the whole batch with the same optimizer, gathers every rank's losses, gradients
(each step, before the optimizer) and final parameters, and compares them with
``torch.testing.assert_close``'s float32 tolerances. It prints the plan, the comparison and
``PASS`` or ``FAIL``; the result it returns makes the command exit 0 or 1.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["run_demo_on_ranks", "LR", "MOMENTUM"]

LR, MOMENTUM = 0.05, 0.9


def _train_eager(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads = [], []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _differs(a: Any, b: Any) -> bool:
    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        return True
    return False


class _Worst:
    """The largest difference seen in one quantity, where, and whether any was out of tolerance."""

    def __init__(self) -> None:
        self.diff, self.where, self.bad = 0.0, "-", False

    def see(self, got: torch.Tensor, want: torch.Tensor, where: str) -> None:
        d = (got - want).abs().max().item() if got.numel() else 0.0
        if d > self.diff:
            self.diff, self.where = d, where
        self.bad |= _differs(got, want)

    def line(self, what: str) -> str:
        return f"{what} max abs difference vs eager {self.diff:.3e} ({self.where})  {'MISMATCH' if self.bad else 'ok'}"


def _compare(every: list[dict], eager: dict, say: Any) -> bool:
    """Prints the comparison of the ranks' results with eager; True when all match."""
    steps = len(eager["losses"])
    losses = _Worst()
    for r, res in enumerate(every):
        for s in range(steps):
            losses.see(torch.tensor(res["losses"][s]), torch.tensor(eager["losses"][s]), f"step {s + 1}, rank {r}")
    grads, params, held = _Worst(), _Worst(), set()
    for r, res in enumerate(every):
        for s in range(steps):
            for n, g in res["grads"][s].items():
                grads.see(g, eager["grads"][s][n], f"{n}, step {s + 1}, rank {r}")
        for n, p in res["params"].items():
            params.see(p, eager["params"][n], f"{n}, rank {r}")
            held.add(n)
    missing = sorted(set(eager["params"]) - held)
    for s in range(steps):
        say(f"step {s + 1}: loss {every[0]['losses'][s]:.6f} (eager {eager['losses'][s]:.6f})")
    say("")
    say(losses.line("losses:    "))
    say(grads.line("gradients: "))
    say(params.line(f"parameters after {steps} SGD step{'s' if steps != 1 else ''}:"))
    if missing:
        say(f"no rank holds: {', '.join(missing)}  MISMATCH")
    ok = not (losses.bad or grads.bad or params.bad or missing)
    say("PASS" if ok else "FAIL")
    return ok


def run_demo_on_ranks(ns: argparse.Namespace) -> Optional[dict]:
    """The demo on this rank; rank 0 returns ``{"ok": ...}``, the others ``None``."""
    import fxpipe
    from fxpipe.cli._demo import make_unet

    from fxpipe.distributed import pipeline

    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a: None)
    model, x = make_unet()
    y = torch.randn(x.shape[0], 2, *x.shape[2:], generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(model) if rank == 0 else None  # before the pipeline: the weights rank 0 sends
    per_rank = ns.stages // world
    say(f"fxpipe {fxpipe.__version__} distributed demo: U-Net ({sum(p.numel() for p in model.parameters()) / 1e3:.1f}k "
        f"params), input {'x'.join(map(str, x.shape))}, {ns.stages} stages on {world} ranks (gloo, 127.0.0.1), "
        f"{ns.chunks} micro-batches, schedule {ns.schedule!r}, balance_by={ns.balance_by!r}")
    pipe = pipeline(model, x, chunks=ns.chunks, loss_fn=F.mse_loss, schedule=ns.schedule, stages_per_rank=per_rank,
                    balance_by=ns.balance_by, timeout=ns.timeout)
    say("")
    say(pipe.plan)
    say("")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads = [], []
    for _ in range(ns.steps):
        losses.append(pipe.step(x, target=y).item())
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    mine = {"local": pipe.local, "losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}
    every: Optional[list[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(mine, every, dst=0)
    pipe.close()
    if rank != 0:
        return None
    assert every is not None and reference is not None
    for r, res in enumerate(every):
        say(f"rank {r}: stage{'s' if len(res['local']) != 1 else ''} {', '.join(map(str, res['local']))}, "
            f"{sum(p.numel() for p in res['params'].values()) / 1e3:.1f}k parameters")
    ok = _compare(every, _train_eager(reference, x, y, ns.steps), say)
    return {"ok": ok}
