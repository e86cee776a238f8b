"""The 1F1B order holds at most ``n - j`` micro-batches' activations on stage ``j``.

Counted, not timed: what a stage's forward saved for backward is tracked through
saved-tensor hooks (one token per task, alive while any tensor it saved is), and what a
checkpointed task keeps (its inputs, for the recomputation) through weak references. GPipe's
order is counted the same way and holds all ``m``: the counting sees what it claims to.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import is_checkpointing, is_recomputing
from fxpipe.runtime._orders import loss_scales

from zoo import unet

N, M = 3, 6


class _Token:
    """One task's saved tensors: alive while any of them is."""

    def __init__(self, live: List[int], j: int) -> None:
        self.live, self.j = live, j
        live[j] += 1
        self.finalizer = weakref.finalize(self, _drop, live, j)


def _drop(live: List[int], j: int) -> None:
    live[j] -= 1


def _held_saved(pipe: fxpipe.Pipeline, run: Callable[[], Any]) -> List[int]:
    """Per stage, the most tasks whose forward-saved tensors were alive at once during ``run``."""
    stages = pipe.stages.modules
    live, most = [0] * len(stages), [0] * len(stages)
    current: List[Any] = [None]

    def pre(j: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            current[0] = None if is_recomputing() else _Token(live, j)
        return hook

    def post(module: Any, args: Any, out: Any) -> None:
        current[0] = None
        for j in range(len(stages)):
            most[j] = max(most[j], live[j])

    def pack(t: torch.Tensor) -> Any:
        return (t, current[0])  # the token lives as long as autograd keeps this

    handles = [s.register_forward_pre_hook(pre(j)) for j, s in enumerate(stages)]
    handles += [s.register_forward_hook(post) for s in stages]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]):
            run()
    finally:
        for h in handles:
            h.remove()
    assert live == [0] * len(stages), f"saved tensors still alive after the step: {live}"
    return most


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(N) for m in (nn.Linear(8, 8), nn.Tanh())])
    return model, torch.randn(M * 2, 8), torch.randint(0, 8, (M * 2,))


def _pipe(model: nn.Module, x: torch.Tensor, schedule: str, checkpoint: str) -> fxpipe.Pipeline:
    return fxpipe.pipeline(model, x, N, chunks=M, devices=["cpu"] * N, checkpoint=checkpoint, schedule=schedule,
                           split_points=["2", "4"], progress=False)


@pytest.mark.parametrize("schedule, expected", [("1f1b", [N - j for j in range(N)]), ("gpipe", [M] * N)])
def test_saved_activations_held_per_stage(schedule, expected):
    model, x, y = _mlp()
    pipe = _pipe(model, x, schedule, "never")
    try:
        held = _held_saved(pipe, lambda: pipe.step(x, loss_fn=F.cross_entropy, target=y))
    finally:
        pipe.close()
    assert held == expected


def test_one_micro_batch_per_stage_at_most_when_one_stage():
    """n = 1: 1F1B is gradient accumulation, one micro-batch's activations at a time."""
    model, x, y = _mlp()
    pipe = fxpipe.pipeline(model, x, 1, chunks=M, devices=["cpu"], checkpoint="never", schedule="1f1b",
                           progress=False)
    try:
        assert _held_saved(pipe, lambda: pipe.step(x, loss_fn=F.cross_entropy, target=y)) == [1]
    finally:
        pipe.close()


def _held_checkpointed_inputs(pipe: fxpipe.Pipeline, run: Callable[[], Any]) -> List[int]:
    """Per stage, the most checkpointed tasks whose inputs were alive at once (sampled at every
    stage call); stage 0's inputs are the user's batch, alive anyway, and left out (0)."""
    stages = pipe.stages.modules
    refs: List[List[List[weakref.ref]]] = [[] for _ in stages]
    most = [0] * len(stages)

    def remember(j: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if is_checkpointing() and j > 0:
                refs[j].append([weakref.ref(a) for a in args if isinstance(a, torch.Tensor)])
            for k, tasks in enumerate(refs):
                most[k] = max(most[k], sum(any(r() is not None for r in task) for task in tasks))
        return hook

    handles = [s.register_forward_pre_hook(remember(j)) for j, s in enumerate(stages)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    assert all(refs[1:]), "no stage ran checkpointed"
    return most


@pytest.mark.parametrize("schedule, expected", [("1f1b", [0] + [N - j for j in range(1, N)]), ("gpipe", [0] + [M] * (N - 1))])
def test_checkpointed_inputs_held_per_stage_with_portals(schedule, expected):
    """'always' on the U-Net, whose long skips cross stages through portals."""
    model, (x,), _ = unet(batch=M)
    pipe = fxpipe.pipeline(model, x, N, chunks=M, devices=["cpu"] * N, checkpoint="always", schedule=schedule,
                           balance_by="params", progress=False)
    try:
        assert pipe.plan.portals
        held = _held_checkpointed_inputs(pipe, lambda: pipe.step(x, loss_fn=lambda out: out.pow(2).mean()))
    finally:
        pipe.close()
    assert held == expected


def test_loss_scales_are_the_merges_gradient():
    like = torch.zeros((), dtype=torch.float64)
    sizes = [3, 3, 1]
    mean = loss_scales(lambda p: torch.stack([x * (n / 7) for x, n in zip(p, sizes)]).sum(), 3, like)
    assert [s.item() for s in mean] == [3 / 7, 3 / 7, 1 / 7]
    assert all(s.dtype == torch.float64 for s in mean)
    assert [s.item() for s in loss_scales(lambda p: p[0] + 0 * p[1], 2, like)] == [1.0, 0.0]
